"""What one model forward needs to know about the batch it runs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Any, Protocol

import torch

from vlm_serve.kv_cache.memory_pool import TokenToKVPool

SAMPLED = -1  # in `ForwardBatch.draft_next_ids`

if TYPE_CHECKING:
    from vlm_serve.llm.layers.sampler import SampleOutput, SampleRow
    from vlm_serve.llm.lora.layer import LoRABatch
    from vlm_serve.llm.prompt_logprobs import PromptLogprobSpan
    from vlm_serve.llm.speculative.draft_state import ChainRequest, DraftState
    from vlm_serve.messages.logprobs import PromptLogprobs


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill: new tokens on top of a (possibly empty) cached prefix
    DECODE = auto()  # one new token per request
    MIXED = auto()  # a prefill chunk plus one new token for each running request, in one forward
    TARGET_VERIFY = auto()  # running requests' last token and draft tokens, verified in one forward

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def extends_prompts(self) -> bool:
        """Whether the batch computes prompt tokens (its requests start decoding after it)."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)


class Attention(Protocol):
    """What the model's layers call on the batch's attention backend (layers/attention's AttentionBackend)."""

    token_to_kv_pool: TokenToKVPool

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float, batch: ForwardBatch
    ) -> torch.Tensor: ...


@dataclass
class ForwardBatch:
    """A flattened batch: the new tokens of all requests back to back, and how to sample after them.

    `seq_lens[i]` is request i's length after this forward, of which `prefix_lens[i]` are already in the
    KV cache and `extend_lens[i]` are new. The new tokens' K/V go to `out_cache_loc`. Vision embeddings
    replace the token embeddings at `mm_indices` (rows of the flattened batch); `deepstack_embeds[k]` is
    added at the same rows after decoder layer k. A negative input id is a token still being sampled by
    the batch before: FutureMap slot `-id - 1`. The sampled tokens go to FutureMap slots
    `future_start ...`, one per request.

    Everything here is built by the scheduler before the forward is launched and only read afterwards,
    so the scheduler can go on changing its pools while the forward runs.
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # (tokens,)
    positions: torch.Tensor  # (3, tokens) MRoPE positions
    req_pool_indices: torch.Tensor  # (batch,)
    seq_lens: torch.Tensor  # (batch,)
    out_cache_loc: torch.Tensor  # (tokens,)
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    mm_indices: torch.Tensor | None = None
    mm_embeds: torch.Tensor | None = None
    deepstack_embeds: list[torch.Tensor] = field(default_factory=list)
    sampling: list[SampleRow] = field(default_factory=list)  # one per request (TARGET_VERIFY: per position)
    future_start: int = 0
    has_futures: bool = True  # whether an input id or a sampling row's output is a future id (False: none is)
    lora: LoRABatch | None = None  # which rows go through which LoRA adapter (None: the base alone)
    prompt_logprob_spans: list[PromptLogprobSpan] = field(default_factory=list)  # rows giving prompt log-probs
    attn_backend: Attention | None = None
    attn_metadata: Any = None  # the backend's index tensors for this batch (`init_forward_metadata`)
    draft_ids: list[list[int]] | None = None  # TARGET_VERIFY: each request's draft tokens (after its last token)
    # TARGET_VERIFY with an EAGLE-3 draft: what it drafts from, at forward time (until then `draft_ids` and
    # the input ids hold placeholders, as many as each request gets)
    chain: list[ChainRequest] | None = None
    keep_aux: bool = True  # whether the target keeps the states an EAGLE-3 draft reads (its extend runs after)
    # with keep_aux, but for a verify batch: the token after each row's position, which the EAGLE-3 draft's
    # extend reads there (SAMPLED: the one this batch samples for the row's request)
    draft_next_ids: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    def sample_groups(self) -> list[range]:
        return sample_groups(self.batch_size, None if self.draft_ids is None else [len(d) for d in self.draft_ids])

    def last_token_indices(self) -> torch.Tensor:
        """Row of each request's last new token: the rows whose logits are sampled."""
        ends = torch.tensor(self.extend_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.input_ids.device)


@dataclass
class ForwardOutput:
    """What a launched forward gives back: the tokens it sampled (a verify batch: at every position),
    and per request the prompt log-probs it computed (None where it computed none)."""

    sample: SampleOutput
    prompt_logprobs: list[PromptLogprobs | None]
    aux_hidden: torch.Tensor | None = None  # every new token's states an EAGLE-3 draft reads (when it runs)
    accepted: list[list[int]] | None = None  # a verify batch: each request's kept tokens (`verify_drafts`)
    draft_states: list[DraftState] | None = None  # with an EAGLE-3 draft: each request's, after this batch

    def to_host(self) -> None:
        self.sample.to_host()


def sample_groups(batch_size: int, num_drafts: list[int] | None) -> list[range]:
    """Each request's rows of a batch's sampling: one, or in a verify batch one per position (1 + its drafts)."""
    sizes = [1] * batch_size if num_drafts is None else [1 + n for n in num_drafts]
    starts = list(itertools.accumulate(sizes, initial=0))
    return [range(a, b) for a, b in zip(starts, starts[1:])]

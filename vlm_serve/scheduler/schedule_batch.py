"""`Req` (one request's state) and `ScheduleBatch` (the requests of one forward, and how they become
the tensors of a `ForwardBatch`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vlm_serve.config import VisionConfig
from vlm_serve.detokenizer import IncrementalDetokenizer, find_stop, find_stop_regex
from vlm_serve.kv_cache.allocator import TokenToKVPoolAllocator
from vlm_serve.kv_cache.memory_pool import ReqToTokenPool
from vlm_serve.kv_cache.radix_cache import RadixCache, TreeNode
from vlm_serve.llm.forward_batch import SAMPLED, ForwardBatch, ForwardMode
from vlm_serve.llm.layers.rotary import mrope_positions
from vlm_serve.llm.layers.sampler import SampleRow, set_drafts
from vlm_serve.llm.lora.layer import LoRABatch
from vlm_serve.llm.models.base import VisionOutput
from vlm_serve.llm.prompt_logprobs import PromptLogprobSpan
from vlm_serve.llm.speculative.draft_state import ChainRequest
from vlm_serve.messages.backend import SpeculativeCounts
from vlm_serve.messages.logprobs import PromptLogprobs
from vlm_serve.multimodal.items import MultimodalItem
from vlm_serve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vlm_serve.disaggregation.transfer import KVReceiver, KVSender
    from vlm_serve.llm.constrained.grammar_backend import Grammar
    from vlm_serve.llm.lora.adapter import TowerAdapter
    from vlm_serve.llm.speculative.draft_state import DraftState
    from vlm_serve.messages.backend import BootstrapInfo

logger = logging.getLogger(__name__)

_EMPTY = torch.empty(0, dtype=torch.int64)
_DISCARDED_ROW = SampleRow(SamplingParams(temperature=0), [], [], 0)  # greedy, and thrown away


@dataclass
class FinishReason:
    """Why a request ended. "abort" is its client's own cancellation; "error" means it could not be
    served, and is never reported as an answer: `status` says whose fault (400 the request's, 5xx the
    server's) and `code` names the cause in a word."""

    kind: str  # "stop" | "length" | "abort" | "error"
    matched: int | str | None = None  # the stop token id or stop string that ended the request
    message: str = ""  # why it was aborted or failed
    status: int = 0  # of an "error": its HTTP status
    code: str = ""  # of an "error": e.g. "encoder_unavailable" (OpenAI's error `code`, the failure metric's label)

    @classmethod
    def error(cls, status: int, code: str, message: str) -> FinishReason:
        return cls("error", message=message, status=status, code=code)


def request_failure(req: Req, where: str, exc: BaseException | str) -> FinishReason:
    """A request's own failure (its sampling, grammar or output), logged: a 500 naming the request, where
    it failed and the cause; the other requests go on."""
    cause = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    logger.error("request %s failed %s: %s", req.rid, where, cause, exc_info=None if isinstance(exc, str) else exc)
    return FinishReason.error(500, "internal_error", f"request {req.rid} failed {where}: {cause}")


@dataclass(eq=False)
class Req:
    """A request inside the scheduler. `origin_input_ids` are padded: each image/video placeholder
    run holds the item's pad value (see `mm_cache.hashing`)."""

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    mm_items: list[MultimodalItem] = field(default_factory=list)
    priority: int = 0
    output_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # prefix match: slots shared with the RadixCache, kept alive by a lock on `last_node`
    prefix_indices: torch.Tensor = _EMPTY
    last_node: TreeNode | None = None
    # and after it, the part of the match in the host tier (HiRadixCache): loaded back when admitted
    last_host_node: TreeNode | None = None
    host_hit_length: int = 0
    # the LoRA adapter it runs through: its slot in the LM's layers (-1: the base, or an adapter of the
    # vision tower alone), its id, which keeps the KV computed through it apart in the prefix cache (0: the
    # base), and its vision-tower part, which the encoders run its pictures through
    lora_slot: int = -1
    lora_id: int = 0
    tower_lora: TowerAdapter | None = None
    # KV state: the request's row in req_to_token_pool holds `kv_len` computed tokens of `fill_ids`
    req_pool_idx: int | None = None
    kv_len: int = 0
    extend_len: int = 0  # tokens the next forward computes
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    # multimodal
    mrope_positions: torch.Tensor | None = None  # (3, prompt len)
    mrope_delta: int = 0  # position of a generated token = its index + delta
    mm_runs: list[tuple[int, int, int, int]] = field(default_factory=list)  # (start, end, item, first row)
    mm_embeds: list[VisionOutput | None] = field(default_factory=list)  # per item, held until prefill is done
    mm_pins: list[int] = field(default_factory=list)  # embedding cache entries pinned for this request
    # sampling and output
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # prompt log-probs, when asked: those of positions before `prompt_logprob_start` are being computed
    # by launched forwards, and join `prompt_logprobs` as their results arrive
    prompt_ids: list[int] = field(init=False)  # the prompt as sent (placeholders not padded): what they score
    prompt_logprob_start: int = 0
    prompt_logprobs: PromptLogprobs = field(default_factory=PromptLogprobs)
    detokenizer: IncrementalDetokenizer | None = None  # only for requests with stop strings or stop_regex
    grammar: Grammar | None = None  # structured output; set when its grammar is compiled
    output_text: str | None = None  # the text cut before the stop string that ended the request
    first_token_time: float | None = None
    to_finish: FinishReason | None = None  # an abort or a failure while it is in a batch: released next step
    # prefill/decode disaggregation: the prefill server its KV comes from or goes to, and the transfer
    bootstrap: BootstrapInfo | None = None
    transfer: KVSender | KVReceiver | None = None
    kv_sent: int = 0  # prefill side: prompt positions whose KV was handed to the transfer
    # speculative decoding: decode steps to go without drafts, after drafts that were all rejected
    draft_pause: int = 0
    draft_backoff: int = 0  # the last pause's length (doubles while drafts keep failing)
    draft_limit: int | None = None  # drafts to propose at most: one more than it kept last time
    spec: SpeculativeCounts = field(default_factory=SpeculativeCounts)  # its drafts, verified and kept
    draft_state: DraftState | None = None  # an EAGLE-3 draft's, after the last forward that computed its tokens
    draft_gap: bool = False  # a decode step ran without the EAGLE-3 draft: its KV misses a position, no more drafts
    verifying: bool = False  # a verify forward of its drafts is in flight (its result says how many it kept)
    # overlap scheduling and streaming
    future_token: int = 0  # the FutureMap id (< 0) of the token a launched batch is sampling for it; 0: none
    send_token_offset: int = 0  # output_ids before this were already reported

    def __post_init__(self) -> None:
        self.prompt_ids = self.origin_input_ids  # (the scheduler pads origin_input_ids into a new list)

    def init_positions(self, vision: VisionConfig) -> None:
        """The prompt's MRoPE positions (and the runs of its media rows), placed as the model's `vision`
        config has them."""
        self.mrope_positions, self.mrope_delta = mrope_positions(len(self.origin_input_ids), self.mm_items, vision)
        self.mm_runs = []
        for i, item in enumerate(self.mm_items):
            row = 0
            for start, end in item.spans:
                self.mm_runs.append((start, end, i, row))
                row += end - start

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def num_outputs(self) -> int:
        """Tokens generated so far, the one still being sampled included."""
        return len(self.output_ids) + (self.future_token != 0)

    @property
    def needs_decode(self) -> bool:
        """Whether another decode step can add to its answer (the token in flight may be its last; how many
        a verify in flight adds is not known yet)."""
        return not self.verifying and self.num_outputs < self.sampling_params.max_new_tokens

    @property
    def settled(self) -> bool:
        """Whether every token it has asked for is known (none in flight): what a step with drafts needs."""
        return self.future_token == 0 and not self.verifying

    def token_ids(self, start: int, end: int) -> list[int]:
        """Ids of positions start..end-1 of `fill_ids`; position `seq_len` is the token in flight."""
        ids = self.fill_ids[start:end]
        if end > self.seq_len:
            ids.append(self.future_token)
        return ids

    def sample_row(self, samples: bool) -> SampleRow:
        """What the sampler needs of it for the batch being built; a chunk before the prompt's end
        samples nothing that is kept (and draws nothing)."""
        params = self.sampling_params
        if not samples:
            return _DISCARDED_ROW
        outputs = []
        if params.has_penalties:
            outputs = self.output_ids + [self.future_token] if self.future_token else list(self.output_ids)
        return SampleRow(params, self.origin_input_ids, outputs, self.num_outputs, self.grammar)

    def verify_rows(self, count: int) -> list[SampleRow]:
        """The sampler's rows for a verify forward with `count` drafts: the position after its last token,
        then after each draft, each as if the drafts before it were kept (`set_drafts` tells them the
        drafts: penalties count them, min_new_tokens too; its grammar is walked through them by the
        sampler)."""
        params = self.sampling_params
        outputs = list(self.output_ids) if params.has_penalties else []
        return [
            SampleRow(params, self.origin_input_ids, outputs, self.num_outputs + j, self.grammar)
            for j in range(count + 1)
        ]

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Whether prompt positions whose log-probs it asked for are still to be computed."""
        last = len(self.origin_input_ids) - 1  # the last prompt position predicts the first output
        return self.sampling_params.prompt_logprobs is not None and self.prompt_logprob_start < last

    def take_prompt_logprob_span(self, index: int, first_row: int, start: int, end: int) -> PromptLogprobSpan:
        """The prompt log-probs of a forward computing its positions start..end-1 (position t predicts
        prompt token t + 1), as row `index` of the batch from row `first_row` of its tokens."""
        if start != self.prompt_logprob_start:  # (its prefix match stops there)
            raise RuntimeError(
                f"request {self.rid}: prompt log-probs due from {self.prompt_logprob_start}, not {start}"
            )
        self.prompt_logprob_start = min(end, len(self.origin_input_ids) - 1)
        targets = self.prompt_ids[start + 1 : self.prompt_logprob_start + 1]
        return PromptLogprobSpan(index, first_row, targets, self.sampling_params.prompt_logprobs)

    def match_prefix(self, tree_cache: RadixCache) -> None:
        """Looks up the cached prefix; at least one token is always left to compute (its logits are
        sampled), and so is every prompt position whose log-prob is still to come (a cached position
        has no logits)."""
        limit = self.prompt_logprob_start if self.prompt_logprobs_pending else self.seq_len - 1
        match = tree_cache.match_prefix(self.cache_key(self.fill_ids[:limit]))
        self.prefix_indices, self.last_node = match.indices, match.last_node
        self.last_host_node, self.host_hit_length = match.last_host_node, match.host_hit_length
        self.extend_len = self.seq_len - len(self.prefix_indices)

    def check_inputs(self, vocab_size: int) -> None:
        """Raises ValueError for a request that can never run: an empty prompt, pixel values that do not
        match their grid, a token id (of the prompt outside its media, of `logit_bias` or `stop_token_ids`)
        outside the vocabulary."""
        if not self.origin_input_ids:
            raise ValueError("the prompt is empty")
        placeholder = [False] * len(self.origin_input_ids)
        for item in self.mm_items:
            shape = item.pixels.values_shape
            if len(shape) != 2 or shape[0] != item.num_patches:
                raise ValueError(
                    f"{item.modality} pixel values of shape {tuple(shape)} do not match its grid "
                    f"{item.grid_thw} ({item.num_patches} patches)"
                )
            for start, end in item.spans:
                placeholder[start:end] = [True] * (end - start)
        bad = [t for t, mm in zip(self.origin_input_ids, placeholder) if not mm and not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})")
        params = self.sampling_params
        for name, token_ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} token id {bad[0]} is outside the vocabulary (size {vocab_size})")

    def check_finished(self, token: int, eos_token_ids: set[int]) -> FinishReason | None:
        """Whether `token`, just appended, ends the answer: a stop token (EOS unless ignored), a stop
        string or pattern in its text, or its length."""
        params = self.sampling_params
        # a grammar allows EOS only where its answer is complete: it ends there even with ignore_eos
        ignore_eos = params.ignore_eos and self.grammar is None
        if token in params.stop_token_ids or (not ignore_eos and token in eos_token_ids):
            return FinishReason("stop", matched=token)
        if params.stop or params.stop_regex:
            new_text = self.detokenizer.update(self.output_ids)
            if new_text and len(self.output_ids) >= params.min_new_tokens:
                hit = find_stop(self.detokenizer.text, params.stop, len(new_text))
                if hit is not None:
                    self.output_text = self.detokenizer.text[: hit[0]]
                    return FinishReason("stop", matched=hit[1])
                # a stop_regex match stays in the answer, as in SGLang (which reports the pattern)
                pattern = find_stop_regex(self.detokenizer.text, params.stop_regex, len(new_text))
                if pattern is not None:
                    return FinishReason("stop", matched=pattern)
        if len(self.output_ids) >= params.max_new_tokens:
            return FinishReason("length")
        return None

    def cache_key(self, ids: list[int]) -> list[int]:
        """The prefix cache's key of its tokens `ids`: through an adapter, each id moved above every id the
        base's keys hold (pad values included), into a range of the adapter's own."""
        if not self.lora_id:
            return ids
        offset = self.lora_id << 64
        return [t + offset for t in ids]

    def reset_kv(self) -> None:
        self.prefix_indices, self.last_node = _EMPTY, None
        self.last_host_node, self.host_hit_length = None, 0
        self.req_pool_idx, self.kv_len, self.extend_len = None, 0, 0


class ScheduleBatch:
    """The requests of one forward, with the pools they take KV memory from.

    In an EXTEND batch each request computes `extend_len` tokens after its `kv_len` cached ones; a
    DECODE batch computes one token per request; a MIXED batch is an EXTEND batch whose last requests
    are running ones computing one token each.
    """

    def __init__(
        self,
        reqs: list[Req],
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        tree_cache: RadixCache,
        forward_mode: ForwardMode = ForwardMode.DECODE,
    ) -> None:
        self.reqs = reqs
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.forward_mode = forward_mode
        self.num_prefill_reqs = len(reqs) if forward_mode == ForwardMode.EXTEND else 0
        self.samples: list[bool] = []  # per request, whether its sampled token is kept (set when prepared)
        self.draft_ids: list[list[int]] | None = None  # TARGET_VERIFY: each request's draft tokens
        self.device = req_to_token_pool.req_to_token.device

    def _evict_for(self, num_tokens: int) -> None:
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)

    # ---- building the forward ----------------------------------------------------------------------

    def mix_with_running(self, running: list[Req]) -> None:
        """Adds running requests to this prefill, each computing its next token."""
        for req in running:
            req.extend_len = 1
        self.reqs = self.reqs + running
        self.forward_mode = ForwardMode.MIXED

    def prepare_for_extend(self) -> ForwardBatch:
        """Each request computes tokens kv_len .. kv_len + extend_len - 1 of its `fill_ids`."""
        for req in self.reqs:
            if req.req_pool_idx is None:
                rows = self.req_to_token_pool.alloc(1)
                if rows is None:
                    raise RuntimeError("no free request rows: the scheduler admitted too many requests")
                req.req_pool_idx = rows[0]
                self.req_to_token_pool.write(req.req_pool_idx, 0, req.prefix_indices)
                req.kv_len = len(req.prefix_indices)
        prefix_lens = [r.kv_len for r in self.reqs]
        seq_lens = [r.kv_len + r.extend_len for r in self.reqs]
        out_cache_loc = self._alloc_slots(prefix_lens, seq_lens, "the scheduler admitted more than the pool holds")
        ids, positions, mm_indices, mm_rows = [], [], [], []
        offset = 0
        self.samples = [end >= req.seq_len for req, end in zip(self.reqs, seq_lens)]
        for req, start, end in zip(self.reqs, prefix_lens, seq_lens):
            ids.extend(req.token_ids(start, end))
            positions.append(_positions(req, start, end))
            for run_start, run_end, i, row in req.mm_runs:  # this chunk's rows of each item's embeddings
                lo, hi = max(run_start, start), min(run_end, end)
                if lo < hi:
                    if i >= len(req.mm_embeds) or req.mm_embeds[i] is None:
                        raise RuntimeError(f"request {req.rid}: no embeddings for its item {i} at prefill")
                    mm_indices.append(torch.arange(offset + lo - start, offset + hi - start))
                    mm_rows.append(req.mm_embeds[i].rows(row + lo - run_start, row + hi - run_start))
            req.kv_len = end
            offset += end - start
        batch = self._forward_batch(ids, torch.cat(positions, dim=1), out_cache_loc, prefix_lens, seq_lens)
        batch.prompt_logprob_spans = self._prompt_logprob_spans(prefix_lens, seq_lens)
        if mm_indices:
            embeds = VisionOutput.cat(mm_rows)
            batch.mm_indices = torch.cat(mm_indices).to(self.device)
            batch.mm_embeds, batch.deepstack_embeds = embeds.embeds, embeds.deepstack
        return batch

    def _alloc_slots(self, prefix_lens: list[int], seq_lens: list[int], why_enough: str) -> torch.Tensor:
        """KV slots for positions prefix_len .. seq_len - 1 of each request (evicting cached prefixes as
        needed), written into its row of req_to_token; `why_enough` says why the pool must hold them."""
        table = self.req_to_token_pool.req_to_token
        self._evict_for(sum(seq_lens) - sum(prefix_lens) + len(self.reqs) * self.allocator.page_size)
        last_locs = [int(table[r.req_pool_idx, n - 1]) if n > 0 else 0 for r, n in zip(self.reqs, prefix_lens)]
        out_cache_loc = self.allocator.alloc_extend(prefix_lens, seq_lens, last_locs)
        if out_cache_loc is None:
            raise RuntimeError(f"KV cache is full: {why_enough}")
        offset = 0
        for req, start, end in zip(self.reqs, prefix_lens, seq_lens):
            self.req_to_token_pool.write(req.req_pool_idx, start, out_cache_loc[offset : offset + end - start])
            offset += end - start
        return out_cache_loc

    def _prompt_logprob_spans(self, prefix_lens: list[int], seq_lens: list[int]) -> list[PromptLogprobSpan]:
        """The rows of this extend whose logits give prompt log-probs, for the requests that asked."""
        spans, row = [], 0
        for i, (req, start, end) in enumerate(zip(self.reqs, prefix_lens, seq_lens)):
            if req.prompt_logprobs_pending:
                spans.append(req.take_prompt_logprob_span(i, row, start, end))
            row += end - start
        return spans

    def prepare_for_decode(self) -> ForwardBatch:
        """One new token per request: the last sampled one. Kept free of per-request tensor work."""
        self.forward_mode = ForwardMode.DECODE
        prefix_lens = [r.kv_len for r in self.reqs]
        seq_lens = [n + 1 for n in prefix_lens]
        pool_idx = torch.tensor([r.req_pool_idx for r in self.reqs], device=self.device)
        prefix_t = torch.tensor(prefix_lens, device=self.device)
        self._evict_for(self.decode_tokens_needed(1))
        last_locs = []
        if self.allocator.page_size > 1:
            last_locs = self.req_to_token_pool.req_to_token[pool_idx, prefix_t - 1].tolist()
        out_cache_loc = self.allocator.alloc_decode(seq_lens, last_locs)
        if out_cache_loc is None:
            raise RuntimeError("KV cache is full: the decode memory check should have retracted requests")
        self.req_to_token_pool.req_to_token[pool_idx, prefix_t] = out_cache_loc.to(torch.int32)
        for req in self.reqs:
            req.kv_len += 1
        self.samples = [True] * len(self.reqs)
        ids = [r.future_token or r.output_ids[-1] for r in self.reqs]
        deltas = torch.tensor([r.mrope_delta for r in self.reqs], device=self.device)
        positions = (prefix_t + deltas).expand(3, -1)
        return self._forward_batch(ids, positions, out_cache_loc, prefix_lens, seq_lens, pool_idx)

    def prepare_for_verify(self, draft_model: bool = False) -> ForwardBatch:
        """Each running request's last token and its draft tokens (`draft_ids`), in one forward whose
        logits verify the drafts. Their KV slots are taken like a prefill's; the scheduler releases those
        of the drafts not kept (`Scheduler.append_verified`). With a `draft_model` (EAGLE-3), `draft_ids`
        only say how many drafts each request gets: the forward drafts them first (`ForwardBatch.chain`),
        writing the draft's KV to the slots taken here."""
        prefix_lens = [r.kv_len for r in self.reqs]
        seq_lens = [n + 1 + len(d) for n, d in zip(prefix_lens, self.draft_ids)]
        out_cache_loc = self._alloc_slots(prefix_lens, seq_lens, "drafts are proposed only where the pool holds them")
        ids, positions, rows = [], [], []
        for req, start, end, drafts in zip(self.reqs, prefix_lens, seq_lens, self.draft_ids):
            ids += [req.output_ids[-1], *drafts]
            positions.append(_positions(req, start, end))
            req_rows = req.verify_rows(len(drafts))
            if not draft_model:
                set_drafts(req_rows, drafts)
            rows += req_rows
            req.kv_len = end
        self.samples = [True] * len(self.reqs)
        batch = self._forward_batch(
            ids, torch.cat(positions, dim=1), out_cache_loc, prefix_lens, seq_lens, sampling=rows
        )
        batch.draft_ids = self.draft_ids
        if draft_model:
            batch.chain = [
                ChainRequest(r.draft_state, r.req_pool_idx, start, r.mrope_delta, len(d))
                for r, start, d in zip(self.reqs, prefix_lens, self.draft_ids)
            ]
        return batch

    def draft_next_ids(self, batch: ForwardBatch) -> list[int]:
        """The token after each row's position of an extend or decode batch (`ForwardBatch.draft_next_ids`):
        the next of the request's tokens, or the one this batch samples for it."""
        ids = []
        for req, start, n in zip(self.reqs, batch.prefix_lens_cpu, batch.extend_lens_cpu):
            following = req.fill_ids[start + 1 : start + 1 + n]
            ids += following + [SAMPLED] * (n - len(following))
        return ids

    def _forward_batch(
        self, ids, positions, out_cache_loc, prefix_lens, seq_lens, pool_idx=None, sampling=None
    ) -> ForwardBatch:
        if pool_idx is None:
            pool_idx = torch.tensor([r.req_pool_idx for r in self.reqs], device=self.device)
        if sampling is None:
            sampling = [r.sample_row(samples) for r, samples in zip(self.reqs, self.samples)]
        return ForwardBatch(
            sampling=sampling,
            forward_mode=self.forward_mode,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions=positions.to(self.device),
            req_pool_indices=pool_idx,
            seq_lens=torch.tensor(seq_lens, device=self.device),
            out_cache_loc=out_cache_loc,
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=[s - p for s, p in zip(seq_lens, prefix_lens)],
            has_futures=any(r.future_token for r in self.reqs),
            lora=LoRABatch.of_runs([s - p for s, p in zip(seq_lens, prefix_lens)], [r.lora_slot for r in self.reqs]),
        )

    # ---- decode memory -----------------------------------------------------------------------------

    def decode_tokens_needed(self, steps: int) -> int:
        """KV slots (whole pages) the running requests take to decode `steps` more tokens."""
        ps = self.allocator.page_size
        if ps == 1:
            return len(self.reqs) * steps
        pages = sum(-(-(r.kv_len + steps) // ps) - -(-r.kv_len // ps) for r in self.reqs)
        return pages * ps

    def check_decode_mem(self) -> bool:
        free = self.allocator.available_size() + self.tree_cache.evictable_size()
        return free >= self.decode_tokens_needed(1)

    def retract_decode(self, steps: int) -> list[Req]:
        """Releases requests (fewest outputs, then longest prompts, first) until the rest can decode
        `steps` more tokens. The retracted ones keep their outputs and are prefilled again later."""
        order = sorted(self.reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
        retracted = []
        while len(order) > 1:
            self.reqs = order
            free = self.allocator.available_size() + self.tree_cache.evictable_size()
            if free >= self.decode_tokens_needed(steps):
                break
            req = order.pop()
            self.tree_cache.cache_finished_req(req)
            retracted.append(req)
        self.reqs = order
        return retracted


def _positions(req: Req, start: int, end: int) -> torch.Tensor:
    """MRoPE positions of tokens start..end-1: the prompt's own, then index + delta for outputs."""
    prompt_len = len(req.origin_input_ids)
    if end <= prompt_len:
        return req.mrope_positions[:, start:end]
    parts = []
    if start < prompt_len:
        parts.append(req.mrope_positions[:, start:prompt_len])
    gen = torch.arange(max(start, prompt_len), end) + req.mrope_delta
    parts.append(gen.expand(3, -1))
    return torch.cat(parts, dim=1)

"""Turns the last-token logits of a batch into next token ids (and log-probs when asked)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Protocol, Sequence

import torch

from vlm_serve.llm.constrained.grammar_backend import accept_grammar_tokens, apply_grammar_masks
from vlm_serve.sampling_params import GREEDY_BELOW, SamplingParams

if TYPE_CHECKING:
    from vlm_serve.llm.constrained.grammar_backend import Grammar


class SamplingRequest(Protocol):
    """What the sampler reads of a request."""

    sampling_params: SamplingParams
    origin_input_ids: list[int]  # prompt ids; ids >= vocab size (image pads) are ignored
    output_ids: list[int]  # read for penalties only
    pending: torch.Tensor | None  # for penalties too: its last token, still on the device (a resolved future)
    num_outputs: int  # tokens generated before the one being sampled (its index; a seeded draw's position)
    grammar: Grammar | None  # structured output: masks the logits, advanced by each sampled token
    # a verify batch's row: the draft token its draw is compared with (None: a plain row, or the
    # position after a request's last draft)
    draft: int | None


@dataclass(slots=True)
class SampleRow:
    """A request's `SamplingRequest`, taken when its batch is built: the request goes on changing while
    the batch runs. `output_ids` is copied only when penalties need it; its last id may be a FutureMap
    slot (negative), for the token the batch before is still producing, which the FutureMap resolves into
    `pending` on the device when this batch runs (so that the host need not wait for it)."""

    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]
    num_outputs: int
    grammar: Grammar | None = None
    draft: int | None = None
    pending: torch.Tensor | None = None


def set_drafts(rows: Sequence[SampleRow], drafts: list[int]) -> None:
    """A verify batch's rows of one request (1 + its drafts), once its drafts are known: row j is compared
    with draft j (the last with none), and its penalties count the drafts before it."""
    for j, row in enumerate(rows):
        row.draft = drafts[j] if j < len(drafts) else None
        if row.sampling_params.has_penalties:
            row.output_ids = row.output_ids + drafts[:j]


@dataclass
class DeviceLogprobs:
    """The log-probs of the rows that asked, as the sampler computed them (on the model's device, or the host
    after `SampleOutput.to_host`): read into `SampleOutput`'s lists on the host's side."""

    rows: list[int]
    chosen: torch.Tensor  # (rows,) the sampled token's
    top_values: torch.Tensor  # (rows, k) best first
    top_ids: torch.Tensor
    counts: list[int]  # per row, how many of the best it asked for


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # (batch,) int64, on the model's device (or the host, after `to_host`)
    logprobs: list[float | None]  # per row: the chosen token's log-prob, None where not asked
    top_logprobs: list[list[tuple[int, float]] | None]  # per row: (token id, log-prob) best first, None where not asked
    failures: dict[int, str] = field(default_factory=dict)  # rows that could not be sampled: why (their token is 0)
    copy_done: torch.cuda.Event | None = None  # recorded after the copy `to_host` started
    device_logprobs: DeviceLogprobs | None = None  # until `tolist` reads them into `logprobs`, `top_logprobs`

    def to_host(self) -> None:
        """Starts copying the tokens (and log-probs) to pinned host memory without waiting (CUDA); `tolist`
        waits."""
        if self.next_token_ids.is_cuda:
            self.next_token_ids = _pinned_copy(self.next_token_ids)
            if (d := self.device_logprobs) is not None:
                d.chosen, d.top_values, d.top_ids = map(_pinned_copy, (d.chosen, d.top_values, d.top_ids))
            self.copy_done = torch.cuda.Event()
            self.copy_done.record()

    def tolist(self) -> list[int]:
        """The tokens, once on the host; the log-probs read into their lists."""
        if self.copy_done is not None:
            self.copy_done.synchronize()
        self.read_logprobs()
        return self.next_token_ids.tolist()

    def read_logprobs(self) -> None:
        if (d := self.device_logprobs) is None:
            return
        chosen, top_values, top_ids = d.chosen.tolist(), d.top_values.tolist(), d.top_ids.tolist()
        for j, (i, n) in enumerate(zip(d.rows, d.counts)):
            self.logprobs[i] = chosen[j]
            if n:
                self.top_logprobs[i] = list(zip(top_ids[j][:n], top_values[j][:n]))
        self.device_logprobs = None


class Sampler:
    """Per step, in this order: repetition/frequency/presence penalties (vLLM's definitions), logit
    bias, the min_new_tokens mask on EOS and stop ids, the grammar mask of structured-output rows,
    log-probs if asked, then argmax for greedy rows and, for the others, temperature, top-k, top-p
    and min-p and a draw — a seeded row draws on the CPU, from its own logits, on a generator of its seed
    and the token's index (`draw_generator`), so its tokens depend on neither the rest of the batch, nor
    drafts, nor the server of a PD pair that samples them. Last, each grammar accepts its row's token.

    A verify batch has a row per position of each request (`draft`); the rows after the first whose token
    differs from the draft there are thrown away (a seeded one is not drawn).

    Log-probs are log_softmax of the logits after penalties, bias and masks but before temperature
    and the top-k/top-p/min-p filters. `logits` is modified in place by the penalties, the bias and
    the masks, to spare copying a (batch, vocab) tensor every step. A grammar decides alone when its
    answer may end: min_new_tokens does not mask EOS on its row.

    A failure is one request's where it can be: a grammar that raises fails its row only, and when the
    batch cannot be sampled, `sample_apart` samples each request alone (the caller decides when)."""

    def __init__(self, stop_token_ids: Iterable[int]):
        self.eos_token_ids = list(stop_token_ids)

    def __call__(self, logits: torch.Tensor, reqs: Sequence[SamplingRequest]) -> SampleOutput:
        """logits: (batch, vocab) float32, one row per request."""
        if all(plain_greedy(r) for r in reqs):
            return SampleOutput(logits.argmax(dim=-1), [None] * len(reqs), [None] * len(reqs))
        params = [r.sampling_params for r in reqs]

        self._apply_penalties(logits, reqs)
        self._apply_logit_bias(logits, reqs)
        self._mask_stop_tokens(logits, reqs)
        apply_grammar_masks(logits, reqs)
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs]
        logprobs = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None

        next_ids = logits.argmax(dim=-1)
        sample_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if sample_rows:
            next_ids[sample_rows] = _sample(logits[sample_rows], [reqs[i] for i in sample_rows])
        out = SampleOutput(next_ids, [None] * len(reqs), [None] * len(reqs), accept_grammar_tokens(next_ids, reqs))

        if logprobs is not None:  # (read on the host's side: `SampleOutput.tolist`)
            chosen = logprobs.gather(1, next_ids[logprob_rows].unsqueeze(1)).squeeze(1)
            counts = [params[i].top_logprobs for i in logprob_rows]
            top_values, top_ids = logprobs.topk(max(counts), dim=-1)
            out.device_logprobs = DeviceLogprobs(logprob_rows, chosen, top_values, top_ids, counts)
        return out

    def sample_apart(
        self, logits_of: Callable[[int, int], torch.Tensor], reqs: Sequence[SamplingRequest], groups: Sequence[range]
    ) -> SampleOutput:
        """After sampling a whole batch raised: each request's rows (`groups`, consecutive) sampled alone,
        from fresh logits (`logits_of(start, stop)`: the failed try changed the batch's in place). The rows
        of a request that fails alone too get token 0 and the error in `failures`."""
        tokens: list[torch.Tensor] = []
        out = SampleOutput(torch.empty(0), [], [])
        for group in groups:
            try:
                part = self(logits_of(group.start, group.stop), reqs[group.start : group.stop])
            except Exception as exc:  # noqa: BLE001 - this request's own failure: reported, the others go on
                part = SampleOutput(torch.zeros(len(group), dtype=torch.long), [None] * len(group), [None] * len(group))
                part.failures = dict.fromkeys(range(len(group)), f"{type(exc).__name__}: {exc}")
            tokens.append(part.next_token_ids.cpu())
            part.read_logprobs()
            out.logprobs += part.logprobs
            out.top_logprobs += part.top_logprobs
            out.failures.update((group.start + row, why) for row, why in part.failures.items())
        out.next_token_ids = torch.cat(tokens)
        return out

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, reqs: Sequence[SamplingRequest]) -> None:
        rows = [i for i, r in enumerate(reqs) if r.sampling_params.has_penalties]
        if not rows:
            return
        params = [reqs[i].sampling_params for i in rows]
        vocab, device = logits.shape[1], logits.device
        # the prompt only matters to the repetition penalty
        prompts = [reqs[i].origin_input_ids if p.repetition_penalty != 1 else [] for i, p in zip(rows, params)]
        seen = _token_counts(prompts, vocab, device) > 0
        counts = _token_counts([reqs[i].output_ids for i in rows], vocab, device)
        pending = [(j, reqs[i].pending) for j, i in enumerate(rows) if reqs[i].pending is not None]
        if pending:  # (tokens the host has not seen yet: counted where they are)
            at = torch.tensor([j for j, _ in pending], device=device)
            tokens = torch.stack([t for _, t in pending])
            counts.index_put_((at, tokens), torch.ones(len(pending), device=device), accumulate=True)
        seen |= counts > 0

        # (a penalty that is 0 as a float32 divides as the smallest one does)
        rep = _column([max(p.repetition_penalty, SMALLEST_PENALTY) for p in params], device)
        sub = logits[rows]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub -= _column([p.frequency_penalty for p in params], device) * counts
        sub -= _column([p.presence_penalty for p in params], device) * (counts > 0)
        logits[rows] = sub.clamp(-LOGIT_BOUND, LOGIT_BOUND)

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, reqs: Sequence[SamplingRequest]) -> None:
        rows, cols, bias = [], [], []
        for i, r in enumerate(reqs):
            for token_id, value in (r.sampling_params.logit_bias or {}).items():
                rows.append(i)
                cols.append(token_id)
                bias.append(value)
        if rows:
            logits[rows, cols] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)

    def _mask_stop_tokens(self, logits: torch.Tensor, reqs: Sequence[SamplingRequest]) -> None:
        """While a request is short of min_new_tokens, it can draw neither EOS nor its stop ids."""
        rows, cols = [], []
        for i, r in enumerate(reqs):
            p = r.sampling_params
            if r.num_outputs < p.min_new_tokens and r.grammar is None:
                ids = {t for t in (*self.eos_token_ids, *p.stop_token_ids) if t < logits.shape[1]}
                rows += [i] * len(ids)
                cols += ids
        if rows:
            logits[rows, cols] = float("-inf")


def plain_greedy(req: SamplingRequest) -> bool:
    """Argmax of the raw logits is all this request needs this step. (is_greedy and has_penalties
    are spelled out: this runs for every request every step, and the property calls double its cost.)"""
    p = req.sampling_params
    return (
        (p.temperature < GREEDY_BELOW or p.top_k == 1)
        and not (p.logprobs or p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1)
        and req.num_outputs >= p.min_new_tokens
        and req.grammar is None
        and not p.logit_bias
    )


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """(len(values), 1) float32, to broadcast one value per row."""
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _token_counts(id_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(len(id_lists), vocab) float counts of each list's ids; ids >= vocab are skipped."""
    flat = [i + row * vocab for row, ids in enumerate(id_lists) for i in ids if i < vocab]
    flat = torch.tensor(flat, dtype=torch.long, device=device)
    counts = torch.zeros(len(id_lists), vocab, device=device)
    return counts.put_(flat, torch.ones_like(flat, dtype=counts.dtype), accumulate=True)


# Penalized logits are kept within +-LOGIT_BOUND: a repetition penalty near 0 (or huge) overflows them, and
# they must stay finite divided by any temperature that is sampled (>= GREEDY_BELOW).
LOGIT_BOUND = 1e30
SMALLEST_PENALTY = torch.finfo(torch.float32).tiny

# When every sampled row has a top-k at most this, only the top-k candidates are sorted and drawn
# from, instead of the whole vocabulary (the published checkpoints default to top_k 20).
TOPK_CANDIDATES_MAX = 1024


def _sample(logits: torch.Tensor, reqs: list[SamplingRequest]) -> torch.Tensor:
    """One draw per row after temperature, top-k, top-p and min-p: the unseeded rows together, each seeded
    one alone (so that the rest of the batch cannot change its draws)."""
    next_ids = torch.empty(len(reqs), dtype=torch.long, device=logits.device)
    seeded = [i for i, r in enumerate(reqs) if r.sampling_params.seed is not None]
    unseeded = [i for i, r in enumerate(reqs) if r.sampling_params.seed is None]
    if unseeded:
        probs, candidates = _filtered_probs(logits[unseeded], [reqs[i] for i in unseeded])
        draws = torch.multinomial(probs, 1)
        next_ids[unseeded] = (draws if candidates is None else candidates.gather(1, draws)).squeeze(1)
    if seeded:
        next_ids[seeded] = _seeded_draws(logits[seeded].cpu(), [reqs[i] for i in seeded]).to(logits.device)
    return next_ids


def _filtered_probs(logits: torch.Tensor, reqs: list[SamplingRequest]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows' probabilities after temperature, top-k, top-p and min-p (not renormalised); when every row
    has a top-k of at most TOPK_CANDIDATES_MAX, over their top candidates only, whose ids come second."""
    params = [r.sampling_params for r in reqs]
    device = logits.device
    top_k = [p.top_k for p in params]
    candidates = None
    if all(0 < k <= TOPK_CANDIDATES_MAX for k in top_k):
        logits, candidates = logits.topk(max(top_k), dim=-1)  # sorted, best first
    probs = torch.softmax(logits / _column([p.temperature for p in params], device), dim=-1)
    if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
        probs = filter_probs(
            probs,
            torch.tensor(top_k, device=device),
            torch.tensor([p.top_p for p in params], device=device),
            torch.tensor([p.min_p for p in params], device=device),
        )
    return probs, candidates


def _seeded_draws(logits: torch.Tensor, reqs: list[SamplingRequest]) -> torch.Tensor:
    """Each row's draw from its own logits alone, on the generator of its seed and position. A row after a
    draft that a draw did not keep is not drawn: its token, thrown away, is its most likely one (a real id:
    log-probs are still read at it)."""
    tokens: list[int] = []
    rejected = False  # whether a draft in the request's rows so far was not kept
    for j, req in enumerate(reqs):
        if rejected:
            tokens.append(int(logits[j].argmax()))
        else:
            probs, candidates = _filtered_probs(logits[j : j + 1], [req])
            generator = draw_generator(req.sampling_params.seed, req.num_outputs)
            draw = int(torch.multinomial(probs[0], 1, generator=generator))
            tokens.append(draw if candidates is None else int(candidates[0, draw]))
        rejected = req.draft is not None and (rejected or tokens[-1] != req.draft)
    return torch.tensor(tokens, dtype=torch.long)


def draw_generator(seed: int, index: int) -> torch.Generator:
    """The generator of a seeded request's token `index`: a hash of both, as torch's CPU generator reads
    only a seed's low 32 bits (seeds 1 and 2**32 + 1 would draw alike)."""
    digest = hashlib.blake2b(b"%d:%d" % (seed, index), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zeroes what top-k, top-p and min-p exclude (not renormalised). probs: (batch, n); top_k,
    top_p, min_p: (batch,), with -1, 1 and 0 for off. As in transformers and vLLM, top-p applies to
    what top-k left (renormalised): it keeps a token while the mass strictly before it is below
    top_p. Min-p keeps p >= min_p * p_max. The top token always stays (a top_p that rounds to 0 too)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[1], device=probs.device)
    keep = (ranks < top_k[:, None]) | (top_k[:, None] < 0)
    top_k_probs = sorted_probs * keep
    top_k_probs = top_k_probs / top_k_probs.sum(dim=-1, keepdim=True)
    # top_p == 1 is off outright: rounding in the cumsum could otherwise drop tail tokens
    keep &= (top_k_probs.cumsum(dim=-1) - top_k_probs < top_p[:, None]) | (top_p[:, None] >= 1) | (ranks == 0)
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)

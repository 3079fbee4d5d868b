"""Which waiting requests go next (`SchedulePolicy`) and how many fit in one prefill (`PrefillAdder`)."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from vlm_serve.config import SCHEDULE_POLICIES
from vlm_serve.kv_cache.radix_cache import RadixCache, TreeNode
from vlm_serve.scheduler.schedule_batch import Req, ScheduleBatch

# Budget estimates clip max_new_tokens here, or one request asking for 100k tokens would block all.
CLIP_MAX_NEW_TOKENS = 4096
# The prefix-aware policies sort by prefix match, which costs a tree walk per request: past this
# queue length they fall back to FCFS.
LPM_FALLBACK_QUEUE_LEN = 128
# In-batch prefix caching: a request with at most CHECK cached tokens that shares at least
# DEPRIORITIZE uncached tokens with a request picked this round waits one round, then hits the cache.
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32


INIT_NEW_TOKEN_RATIO = 0.7  # share of max_new_tokens running requests are assumed to still use
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # the ratio decays to this fraction of its initial value
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # decode steps to decay from initial to minimum


@dataclass
class NewTokenRatio:
    """The share of their remaining `max_new_tokens` that running requests are assumed to still generate
    when a prefill is admitted (`PrefillAdder`): high at first (times `--schedule-conservativeness`), lower
    with every decode step that finds room, and set from the running requests after a retraction."""

    conservativeness: float = 1.0
    value: float = field(init=False)

    def __post_init__(self) -> None:
        self.init = min(INIT_NEW_TOKEN_RATIO * self.conservativeness, 1.0)
        self.min = self.init * MIN_NEW_TOKEN_RATIO_FACTOR
        self.value = self.init

    def decay(self) -> None:
        self.value = max(self.value - (self.init - self.min) / NEW_TOKEN_RATIO_DECAY_STEPS, self.min)

    def after_retraction(self, running: list[Req], steps: int) -> None:
        """What the requests left running will use: what they decoded plus `steps` more each, of their
        max_new_tokens."""
        total_max_new = sum(r.sampling_params.max_new_tokens for r in running)
        decoded = sum(len(r.output_ids) for r in running)
        self.value = min(1.0, (decoded + steps * len(running)) / max(total_max_new, 1))


class SchedulePolicy:
    """Orders `waiting_queue` before each prefill round."""

    def __init__(self, policy: str, tree_cache: RadixCache, enable_priority: bool, seed: int = 0) -> None:
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, not {policy!r}")
        self.policy = policy
        self.tree_cache = tree_cache
        self.enable_priority = enable_priority
        self.rng = random.Random(seed)

    def calc_priority(self, waiting_queue: list[Req]) -> bool:
        """Sorts `waiting_queue` in place (stable, so FCFS order breaks ties). Returns whether every
        request's prefix was matched on the way (the prefix-aware policies need it)."""
        policy = self.policy
        if policy in ("lpm", "dfs-weight") and (len(waiting_queue) > LPM_FALLBACK_QUEUE_LEN or self.tree_cache.disable):
            policy = "fcfs"
        if policy in ("lpm", "dfs-weight"):
            for req in waiting_queue:
                req.match_prefix(self.tree_cache)
        if policy == "lpm":
            waiting_queue.sort(key=lambda r: -len(r.prefix_indices))
        elif policy == "dfs-weight":
            waiting_queue[:] = self._dfs_weight_order(waiting_queue)
        elif policy == "lof":
            waiting_queue.sort(key=lambda r: -r.sampling_params.max_new_tokens)
        elif policy == "random":
            self.rng.shuffle(waiting_queue)
        if self.enable_priority:
            waiting_queue.sort(key=lambda r: -r.priority)
        return policy in ("lpm", "dfs-weight")

    def _dfs_weight_order(self, reqs: list[Req]) -> list[Req]:
        """Depth-first over the tree, heavier subtrees (more waiting requests below) first, so that
        requests sharing a prefix run close together; requests with no cached prefix come last."""
        reqs_at: dict[TreeNode, list[Req]] = defaultdict(list)
        for req in reqs:
            reqs_at[req.last_node].append(req)
        weight: dict[TreeNode, int] = defaultdict(int)
        children: dict[TreeNode, set[TreeNode]] = defaultdict(set)
        for node, at in reqs_at.items():
            while node is not None:
                weight[node] += len(at)
                if node.parent is not None:
                    children[node.parent].add(node)
                node = node.parent
        order: list[Req] = []
        stack: list[tuple[TreeNode, bool]] = [(self.tree_cache.root, False)]
        while stack:  # post-order: a node's own requests after its subtrees'
            node, expanded = stack.pop()
            if expanded:
                order.extend(reqs_at.get(node, []))
                continue
            stack.append((node, True))
            # pushed lightest first so that the heaviest subtree is visited first
            stack.extend((n, False) for n in sorted(children[node], key=lambda n: (weight[n], -n.last_access)))
        return order


class InBatchPrefixes:
    """The uncached tokens of the requests picked this round, for in-batch prefix caching: a request that
    shares enough of them with one picked waits a round, and then hits the cache."""

    def __init__(self, tree_cache: RadixCache) -> None:
        self.enabled = not tree_cache.disable
        self.tree = RadixCache(None, None)

    def should_wait(self, req: Req) -> bool:
        if not self.enabled or req.prompt_logprobs_pending:
            return False
        if len(req.prefix_indices) > IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD:
            return False
        uncached = req.cache_key(req.fill_ids[len(req.prefix_indices) :])
        return len(self.tree.match_prefix(uncached).indices) >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD

    def add(self, req: Req) -> None:
        if self.enabled:
            uncached = req.cache_key(req.fill_ids[len(req.prefix_indices) :])
            self.tree.insert(uncached, torch.zeros(len(uncached), dtype=torch.int64))


class AddReqResult(Enum):
    CONTINUE = auto()  # room for more
    NO_TOKEN = auto()  # out of KV memory
    OTHER = auto()  # another budget (input tokens, chunk, rows) is spent


class PrefillAdder:
    """Picks the requests of one prefill batch under three budgets.

    - `rem_total_tokens`: free + evictable KV, minus what running requests are expected to still
      generate (`new_token_ratio` of their clipped remaining max_new_tokens; all of it for ignore_eos).
    - `rem_input_tokens`: new prompt tokens per prefill (`max_prefill_tokens`).
    - `rem_chunk_tokens`: the chunk size; a request longer than what is left is cut (page-aligned)
      and becomes the `new_chunked_req`. None when chunked prefill is off.
    """

    def __init__(
        self,
        tree_cache: RadixCache,
        running_batch: ScheduleBatch,
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        mixed_decode_tokens: int = 0,
    ) -> None:
        self.tree_cache = tree_cache
        self.allocator = running_batch.allocator
        self.page_size = self.allocator.page_size
        self.new_token_ratio = new_token_ratio
        self.rem_input_tokens = max_prefill_tokens - mixed_decode_tokens
        self.rem_chunk_tokens = None if chunked_prefill_size is None else chunked_prefill_size - mixed_decode_tokens
        self.rem_total_token_offset = mixed_decode_tokens + sum(self.reserved_tokens(r) for r in running_batch.reqs)
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Req | None = None

    @property
    def rem_total_tokens(self) -> int:
        free = self.allocator.available_size() + self.tree_cache.evictable_size()
        return free - self.rem_total_token_offset

    def reserved_tokens(self, req: Req) -> int:
        """KV a running request is expected to still need."""
        left = max(req.sampling_params.max_new_tokens - len(req.output_ids), 0)
        if req.sampling_params.ignore_eos:
            return left  # it will surely use all of it
        return int(min(left, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)

    def _new_tokens_estimate(self, req: Req) -> int:
        left = max(req.sampling_params.max_new_tokens - len(req.output_ids), 0)
        return left if req.sampling_params.ignore_eos else min(left, CLIP_MAX_NEW_TOKENS)

    def _take(self, req: Req, extend_len: int, new_tokens: int) -> None:
        self.can_run_list.append(req)
        # a request's first page may be partly used: count whole pages
        self.rem_total_token_offset += extend_len + new_tokens + self.page_size
        self.rem_input_tokens -= extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_len

    def budget_state(self) -> AddReqResult:
        if self.rem_total_tokens <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def add_chunked_req(self, req: Req) -> Req | None:
        """The next chunk of the request being chunked; returns it while chunks remain, else None.
        It always gets a chunk, even over budget: it holds KV that only finishing it releases."""
        rem = self.rem_chunk_tokens if self.rem_chunk_tokens is not None else self.rem_input_tokens
        rem = min(rem, self.rem_total_tokens)
        rem = max(rem - rem % self.page_size, self.page_size)
        truncated = req.extend_len > rem
        req.extend_len = min(req.extend_len, rem)
        self._take(req, req.extend_len, 0 if truncated else self._new_tokens_estimate(req))
        return req if truncated else None

    def add_one_req(self, req: Req) -> AddReqResult:
        """Admits `req` (whose prefix was matched) whole or as the first chunk, if the budgets allow."""
        input_tokens = req.extend_len
        total_tokens = input_tokens + self._new_tokens_estimate(req) + self.page_size
        if input_tokens >= self.rem_input_tokens and self.can_run_list:
            return AddReqResult.OTHER
        self.tree_cache.inc_lock_ref(req.last_node)  # its prefix is in use from now on
        if total_tokens > self.rem_total_tokens:
            self.tree_cache.dec_lock_ref(req.last_node)
            return AddReqResult.NO_TOKEN
        if req.host_hit_length:  # the rest of its prefix is in the host tier: back to the device before it runs
            if not self.tree_cache.load_back_for(req):
                self.tree_cache.dec_lock_ref(req.last_node)
                return AddReqResult.NO_TOKEN
            req.extend_len = input_tokens = req.seq_len - len(req.prefix_indices)
        if self.rem_chunk_tokens is None or input_tokens <= self.rem_chunk_tokens:
            self._take(req, input_tokens, self._new_tokens_estimate(req))
        else:
            trunc = self.rem_chunk_tokens - self.rem_chunk_tokens % self.page_size
            if trunc <= 0:
                self.tree_cache.dec_lock_ref(req.last_node)
                return AddReqResult.OTHER
            req.extend_len = trunc
            self._take(req, trunc, 0)
            self.new_chunked_req = req
        return self.budget_state()

    def add_prompt_kv(self, req: Req) -> bool:
        """Counts a request whose whole prompt's KV is allocated now without a prefill (the decode side of
        PD, where it arrives by transfer), if the budget holds it and what it may generate, as
        `add_one_req` admits a prefill."""
        prompt_len = len(req.origin_input_ids)
        if prompt_len + self._new_tokens_estimate(req) + self.page_size > self.rem_total_tokens:
            return False
        self._take(req, prompt_len, self._new_tokens_estimate(req))
        return True

    def add_one_req_preempting(
        self, req: Req, running_batch: ScheduleBatch, threshold: int
    ) -> tuple[AddReqResult, list[Req]]:
        """`add_one_req`, and when `req` itself did not fit, `preempt_to_schedule` then one more try.
        Returns the result and the released requests. (A request admitted with the budget's last tokens
        also answers NO_TOKEN: it must not be preempted for, nor admitted twice.)"""
        result = self.add_one_req(req)
        if result != AddReqResult.NO_TOKEN or (self.can_run_list and self.can_run_list[-1] is req):
            return result, []
        victims = self.preempt_to_schedule(req, running_batch, threshold)
        if victims:
            result = self.add_one_req(req)
        return result, victims

    def preempt_to_schedule(self, req: Req, running_batch: ScheduleBatch, threshold: int) -> list[Req]:
        """Frees room for a high-priority `req` by releasing running requests whose priority is lower
        by more than `threshold`, lowest first. Returns the released requests (to requeue), or [] when
        releasing all candidates would still not make room."""
        need = req.extend_len + self._new_tokens_estimate(req) + self.page_size - self.rem_total_tokens
        victims, freed = [], 0
        for r in sorted(running_batch.reqs, key=lambda r: (r.priority, -r.arrival_time)):
            if req.priority - r.priority <= threshold or freed >= need:
                break
            victims.append(r)
            freed += r.kv_len - len(r.prefix_indices) + self.reserved_tokens(r)
        if not victims or freed < need:
            return []
        for r in victims:
            self.rem_total_token_offset -= self.reserved_tokens(r)
            self.tree_cache.cache_finished_req(r)
        running_batch.reqs = [r for r in running_batch.reqs if r not in victims]
        return victims

"""The encoding stage: where a request with images or videos waits for their embeddings, in front of
`waiting_queue`.

It owns the embedding cache (content hash, and the vision tower's LoRA adapter that made them -> vision
embeddings and deepstack features). For each item a request needs, in this order: an item whose whole
token span the prefix cache already covers is not needed at all; an item already being encoded for
another request is waited for (single flight: the vision tower runs once for it however many requests
want it at once); a cached item is taken from the cache; anything else is submitted to the encoder. A
request is ready when it holds every item it needs. From then until its prefill is done it keeps those cache entries pinned, so they cannot be
evicted under it, and chunked prefill takes each chunk's rows straight from them.
"""

from __future__ import annotations

from vlm_serve.llm.models.base import VisionOutput
from vlm_serve.mm_cache.cache import MultimodalCache
from vlm_serve.scheduler.schedule_batch import FinishReason, Req
from vlm_serve.vision.encoder import EncodeResult, EncodeTask, VisionEncoder, embedding_key


class EncodingStage:
    """Requests waiting for vision embeddings; `poll` hands back the ready and the failed ones.

    With tensor parallelism every rank keeps the same requests here, but only rank 0 has the encoder and
    the cache (`encoder` None elsewhere): the others hold a request until rank 0 says it is ready and
    hands its embeddings over (`receive`)."""

    def __init__(self, encoder: VisionEncoder | None, cache_bytes: int) -> None:
        self.encoder = encoder
        self.cache: MultimodalCache[VisionOutput] = MultimodalCache(cache_bytes)
        self.inflight: dict[int, list[tuple[Req, int]]] = {}  # hash -> (request, item index) waiting on it
        self.outstanding: dict[Req, int] = {}  # requests in the stage -> items still to arrive
        self.to_submit: list[EncodeTask] = []  # new items, handed to the encoder together at the next poll
        self.ready_now: list[Req] = []  # every item was cached: ready at the next poll
        self.inflight_hits = 0  # items that waited for an encode already in flight (not cache misses)

    def __len__(self) -> int:
        return len(self.outstanding)

    def __contains__(self, req: Req) -> bool:
        return req in self.outstanding

    def add(self, req: Req, covered: int) -> bool:
        """Whether `req` must wait here: it lacks the embeddings of an item reaching past its first
        `covered` tokens (those before are in the prefix cache). The answer is the same on every TP
        rank; what rank 0 does about it (cache hits, encoder submissions) shows at the next `poll`."""
        if len(req.mm_embeds) != len(req.mm_items):
            req.mm_embeds = [None] * len(req.mm_items)
        needed = []
        for i, item in enumerate(req.mm_items):
            if req.mm_embeds[i] is not None:
                continue
            if item.spans[-1][1] <= covered:
                item.timings.embedding_source = "prefix"
            else:
                needed.append(i)
        if not needed:
            return False
        missing = len(needed)
        for i in needed if self.encoder is not None else ():
            item, key = req.mm_items[i], embedding_key(req.mm_items[i].hash, req.tower_lora)
            if key in self.inflight:  # (then it is not in the cache: its result goes there on arrival)
                self.inflight_hits += 1
                self.inflight[key].append((req, i))
                continue
            cached = self.cache.get(key)
            if cached is not None:
                item.timings.embedding_source = "cache"
                self._hold(req, i, cached)
                missing -= 1
                continue
            self.inflight[key] = [(req, i)]
            self.to_submit.append(EncodeTask(key, item.grid_thw, item.pixels, req.tower_lora))
        self.outstanding[req] = missing
        if missing == 0:
            self.ready_now.append(req)
        return True

    def poll(self, timeout: float = 0.0, llm_busy: bool = False) -> tuple[list[Req], list[tuple[Req, FinishReason]]]:
        """Rank 0: takes the encoder's finished results: (requests now ready, (request, why it failed)).
        `llm_busy`: requests are running (an encoder in the scheduler's process then works beside them).
        An item no encoder could run (its ranks died) fails its requests with a 503, one the vision tower
        raised on with a 500: either way the server's failure, not the request's."""
        ready = [r for r in self.ready_now if self.outstanding.pop(r, None) is not None]
        self.ready_now = []
        failed: list[tuple[Req, FinishReason]] = []
        if self.to_submit:
            self.encoder.submit(self.to_submit)
            self.to_submit = []
        for result in self.encoder.poll(timeout, llm_busy):
            waiters = [(r, i) for r, i in self.inflight.pop(result.key, []) if r in self.outstanding]
            if result.output is None:
                status, code = (503, "encoder_unavailable") if result.unavailable else (500, "encoder_error")
                for req, i in waiters:
                    if req in self.outstanding:
                        message = f"{req.mm_items[i].modality} {i} of the request could not be encoded: {result.error}"
                        failed.append((req, FinishReason.error(status, code, message)))
                        self.remove(req)
                continue
            self.cache.put(result.key, result.output, result.output.nbytes)
            for req, i in waiters:
                self._arrived(req, i, result)
                self.outstanding[req] -= 1
                if self.outstanding[req] == 0:
                    del self.outstanding[req]
                    ready.append(req)
        return ready, failed

    def receive(self, req: Req, embeds: dict[int, VisionOutput]) -> None:
        """A TP rank other than 0: rank 0 found `req` ready, with these embeddings (by item index)."""
        for i, output in embeds.items():
            req.mm_embeds[i] = output
        del self.outstanding[req]

    def _arrived(self, req: Req, i: int, result: EncodeResult) -> None:
        timings = req.mm_items[i].timings
        timings.embedding_source = "encoder"
        timings.encoder_wait, timings.vit = result.wait, result.vit
        self._hold(req, i, result.output)

    def _hold(self, req: Req, i: int, output: VisionOutput) -> None:
        req.mm_embeds[i] = output
        key = embedding_key(req.mm_items[i].hash, req.tower_lora)
        if key in self.cache:
            self.cache.pin(key)
            req.mm_pins.append(key)

    def remove(self, req: Req) -> None:
        """Takes `req` out of the stage (aborted or failed) and releases what it holds."""
        self.outstanding.pop(req, None)
        self.release(req)

    def release(self, req: Req) -> None:
        """After `req`'s prefill (or its end): unpins its entries and drops its references to them."""
        for key in req.mm_pins:
            self.cache.unpin(key)
        req.mm_pins = []
        req.mm_embeds = []

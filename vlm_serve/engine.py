"""The in-process engine: chat template, media preprocessing and the scheduler, without HTTP.

Single-threaded: each call drives the scheduler until its own requests finish. Requests submitted in
one call (a batch, or `n` > 1) are scheduled together with continuous batching.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlm_serve.config import ModelConfig, ServerArgs
from vlm_serve.detokenizer import TextStream, final_text, stop_holdback
from vlm_serve.llm.model_runner import ModelRunner
from vlm_serve.llm.scheduler.schedule_batch import Req
from vlm_serve.llm.scheduler.scheduler import Scheduler
from vlm_serve.sampling_params import SamplingParams, generation_defaults, sampling_params_from_openai
from vlm_serve.testing.tiny_model import default_model_path
from vlm_serve.tokenizer import Tokenizer
from vlm_serve.vision.items import MediaTimings, ProcessedInput
from vlm_serve.vision.processor import MultimodalProcessor

@dataclass
class Completion:
    """One generated answer (one of the `n` choices)."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[float] | None = None  # of each chosen token, if asked
    top_logprobs: list[list[tuple[int, float]]] | None = None  # (token id, logprob), best first
    message: str = ""  # why it was aborted (e.g. an image that could not be encoded)


@dataclass
class GenerateOutput:
    """The answer to one prompt: its `choices` plus usage. `.text` / `.token_ids` are the first choice's."""

    choices: list[Completion]
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    media_timings: list[MediaTimings] = field(default_factory=list)  # per image / video, in prompt order

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason


@dataclass
class StreamChunk:
    """New output of one choice: `text` and `token_ids` added since the last chunk."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass(eq=False)
class Submission:
    """A prompt queued with `Engine.submit`: its `n` choices' requests."""

    reqs: list[Req]

    @property
    def done(self) -> bool:
        return all(r.finished for r in self.reqs)


class Engine:
    """`Engine(model=path, dtype="float32").chat(messages, max_tokens=16, temperature=0).text`.

    `model=None` uses the built-in tiny MoE checkpoint. Other keywords are `ServerArgs` fields
    (`chunked_prefill_size`, `schedule_policy`, `page_size`, `max_total_tokens`, ...). Sampling keywords
    are named as in the OpenAI API (`max_tokens`, `temperature`, `top_p`, `stop`, `seed`, `n`, ...).
    """

    def __init__(self, model: str | Path | None = None, **options: Any) -> None:
        known = {f.name for f in dataclasses.fields(ServerArgs)} - {"model"}
        unknown = set(options) - known
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        path = Path(model) if model is not None else default_model_path()
        self.server_args = ServerArgs(model=str(path), **options)
        self.model_config = ModelConfig.from_pretrained(path)
        self.tokenizer = Tokenizer.from_pretrained(path)
        self.processor = MultimodalProcessor.from_pretrained(path, self.tokenizer, cache_mb=self.server_args.mm_cache_mb)
        runner = ModelRunner(self.server_args, self.model_config)
        self.scheduler = Scheduler(self.server_args, runner, self.tokenizer)
        self.default_sampling = generation_defaults(path)
        self._ids = itertools.count()

    # ---- blocking calls ----------------------------------------------------------------------------

    def chat(self, messages: list[dict], **kwargs: Any) -> GenerateOutput:
        """One conversation in OpenAI form (image/video parts as paths, data URLs or PIL images)."""
        return self.chat_batch([messages], **kwargs)[0]

    def chat_batch(self, conversations: list[list[dict]], **kwargs: Any) -> list[GenerateOutput]:
        inputs = [self.processor.process_messages(m, add_generation_prompt=True) for m in conversations]
        return self.generate_processed(inputs, **kwargs)

    def generate(self, prompt: str, images: list | None = None, videos: list | None = None, **kwargs: Any):
        """Raw prompt text containing one `<|image_pad|>` / `<|video_pad|>` per image / video."""
        processed = self.processor.process(prompt, images=images or [], videos=videos or [])
        return self.generate_processed([processed], **kwargs)[0]

    def generate_processed(self, inputs: list[ProcessedInput], priority: int = 0, **sampling: Any) -> list[GenerateOutput]:
        """Already tokenized and preprocessed inputs, all scheduled together."""
        params = self.sampling_params(**sampling)
        groups: list[list[Req]] = []
        try:
            for x in inputs:
                groups.append(self._submit(x, params, priority))
        except ValueError:
            self._abort_and_wait([r for g in groups for r in g], "another input of the same call was rejected")
            raise
        pending = [r for g in groups for r in g]
        while not all(r.finished for r in pending):
            self.step()
        return [self._output(g) for g in groups]

    # ---- driving the scheduler yourself ------------------------------------------------------------

    def submit(self, x: ProcessedInput, priority: int = 0, **sampling: Any) -> Submission:
        """Queues one prompt and returns at once: call `step()` until `done`, then `result()`. Prompts
        submitted this way are batched continuously with everything else in flight."""
        return Submission(self._submit(x, self.sampling_params(**sampling), priority))

    def result(self, submission: Submission) -> GenerateOutput:
        if not submission.done:
            raise ValueError("the submission has not finished yet")
        return self._output(submission.reqs)

    # ---- streaming ---------------------------------------------------------------------------------

    def stream(self, messages: list[dict], priority: int = 0, **sampling: Any) -> Iterator[StreamChunk]:
        """Chat with the answer arriving piece by piece. Closing the iterator early aborts the request."""
        params = self.sampling_params(**sampling)
        reqs = self._submit(self.processor.process_messages(messages, add_generation_prompt=True), params, priority)
        streams = [TextStream(self.tokenizer, stop_holdback(params.stop)) for _ in reqs]
        sent_ids = [0] * len(reqs)
        done = [False] * len(reqs)
        try:
            while not all(done):
                self.step()
                for i, req in enumerate(reqs):
                    if done[i] or len(req.output_ids) == sent_ids[i] and not req.finished:
                        continue
                    if req.finished:
                        text = streams[i].finish(req.output_ids, req.finished_reason.matched, req.output_text)
                    else:
                        text = streams[i].update(req.output_ids)
                    chunk = StreamChunk(
                        i, text, req.output_ids[sent_ids[i] :], req.finished_reason.kind if req.finished else None
                    )
                    sent_ids[i], done[i] = len(req.output_ids), req.finished
                    if chunk.text or chunk.token_ids or chunk.finish_reason:
                        yield chunk
        finally:
            self._abort_and_wait(reqs, "the stream was closed")

    # ---- plumbing ----------------------------------------------------------------------------------

    def sampling_params(self, **sampling: Any) -> SamplingParams:
        """OpenAI-named sampling keywords over the checkpoint's generation defaults."""
        return sampling_params_from_openai(self.default_sampling, sampling)

    def _submit(self, x: ProcessedInput, params: SamplingParams, priority: int) -> list[Req]:
        """Queues the request's `n` choices."""
        if self.scheduler is None:
            raise RuntimeError("the engine was shut down")
        base = str(next(self._ids))
        reqs: list[Req] = []
        try:
            for i, choice in enumerate(params.per_choice()):
                req = Req(f"{base}-{i}", list(x.input_ids), choice, list(x.mm_items), priority=priority)
                self.scheduler.add_request(req)
                reqs.append(req)
        except ValueError:
            self._abort_and_wait(reqs, "rejected")
            raise
        return reqs

    def _abort_and_wait(self, reqs: list[Req], message: str) -> None:
        for req in reqs:
            if not req.finished:
                self.scheduler.abort_request(req.rid, message)
        while not all(r.finished for r in reqs):
            self.step()

    def step(self) -> None:
        """One scheduler step (waits briefly when only media encoding is under way)."""
        if self.scheduler is None:
            raise RuntimeError("the engine was shut down")
        self.scheduler.step()
        if self.scheduler.last_batch is None and not self.scheduler.is_idle() and not self.scheduler.encoding.inflight:
            raise RuntimeError("the scheduler made no progress with requests waiting (a scheduling bug)")

    def _completion(self, req: Req) -> Completion:
        reason = req.finished_reason
        params = req.sampling_params
        return Completion(
            final_text(self.tokenizer, req.output_ids, reason.matched, req.output_text), list(req.output_ids), reason.kind, reason.matched,
            req.output_logprobs if params.logprobs else None,
            req.output_top_logprobs if params.top_logprobs else None,
            reason.message,
        )

    def _output(self, reqs: list[Req]) -> GenerateOutput:
        return GenerateOutput(
            [self._completion(r) for r in reqs],
            len(reqs[0].origin_input_ids),
            max(r.cached_tokens for r in reqs),
            [item.timings for item in reqs[0].mm_items],
        )

    def shutdown(self) -> None:
        """Stops the encoder pool's processes; the engine takes no requests afterwards."""
        if self.scheduler is not None:
            self.scheduler.shutdown()
            self.scheduler = None  # type: ignore[assignment]

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

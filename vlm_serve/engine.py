"""The in-process engine: chat template, media preprocessing, the scheduler and the detokenizer, without
HTTP.

It is a front end like the server's TokenizerManager: requests become `GenerateReqInput`s, then
scheduler messages, handed over in a queue; the scheduler runs its own event loop one iteration per
`step()`, and its outputs come back as text through the same `DetokenizerManager` the server's
detokenizer process runs. Each blocking call steps until its own requests finish; requests submitted
together (a batch, or `n` > 1) are scheduled together with continuous batching.

A request that could not be served never comes back as an answer: the call raises the error the server
would answer with (`vlm_serve.errors`): `BadRequest` (a ValueError) when the request is at fault
(refused by the scheduler, an invalid grammar), `ServiceUnavailable` when the server cannot serve it now
(no encoder rank could encode its image, its grammar did not compile in time), `InternalError` when
something failed that should not have (the vision tower raised on its image). Only `Engine.abort` (or
closing a stream) ends a request with finish reason "abort". A failure of the engine itself (the
scheduler's idle self-check finding leaked memory: a bug) raises RuntimeError, again at each idle step.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlm_serve.config import ENGINE_CONCERNS, DisaggregationSettings, ModelConfig, ServerArgs
from vlm_serve.llm.lora.adapter import LoRAError
from vlm_serve.llm.model_runner import ModelRunner, RunnerConcerns
from vlm_serve.messages.backend import (
    AbortReq,
    BatchTokenIdOut,
    BootstrapInfo,
    LoadLoRAReq,
    SpeculativeCounts,
    UnloadLoRAReq,
)
from vlm_serve.messages.frontend import GenerateReqInput, StrOut
from vlm_serve.messages.logprobs import PromptLogprobs
from vlm_serve.model_source import with_local_model
from vlm_serve.multimodal.items import MediaTimings, ProcessedInput
from vlm_serve.multimodal.processor import MultimodalProcessor
from vlm_serve.sampling_params import SamplingParams, generation_defaults, sampling_params_from_openai
from vlm_serve.scheduler.concerns import SchedulerConcerns
from vlm_serve.scheduler.scheduler import Scheduler
from vlm_serve.server.detokenizer_manager import DetokenizerManager
from vlm_serve.tokenizer import Tokenizer
from vlm_serve.vision.pool import EncoderConcerns, create_encoder


@dataclass
class Completion:
    """One generated answer (one of the `n` choices)."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" (by `Engine.abort`)
    matched_stop: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[float] | None = None  # of each chosen token, if asked
    top_logprobs: list[list[tuple[int, float]]] | None = None  # (token id, logprob), best first
    message: str = ""  # why it was aborted
    spec: SpeculativeCounts | None = None  # its drafts, verified and kept (speculative decoding on)


@dataclass
class GenerateOutput:
    """The answer to one prompt: its `choices` plus usage. `.text` / `.token_ids` are the first choice's."""

    choices: list[Completion]
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    media_timings: list[MediaTimings] = field(default_factory=list)  # per image / video, in prompt order
    prompt_logprobs: PromptLogprobs | None = None  # with `prompt_logprobs=k`: prompt tokens 1.. (0 has none)

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
    """New output of one choice: `text` and `token_ids` added since the last chunk; a stream's last chunk
    carries the whole answer with its usage (`output`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    output: GenerateOutput | None = None


@dataclass(eq=False)
class _Choice:
    """The outputs of one choice as they arrive from the detokenizer."""

    rid: str
    outs: list[StrOut] = field(default_factory=list)
    unread: int = 0  # outputs before this were handed out by a stream

    @property
    def failed(self) -> bool:
        return bool(self.outs) and self.outs[-1].finish_reason == "error"

    @property
    def finished(self) -> bool:
        return bool(self.outs) and self.outs[-1].finish_reason is not None

    def completion(self) -> Completion:
        last = self.outs[-1]
        return Completion(
            "".join(o.text for o in self.outs),
            [t for o in self.outs for t in o.new_ids],
            last.finish_reason,
            last.matched_stop,
            [lp for o in self.outs for lp in o.logprobs] or None,
            [top for o in self.outs for top in o.top_logprobs] or None,
            last.message,
            last.spec,
        )


@dataclass(eq=False)
class Submission:
    """A prompt queued with `Engine.submit`: its `n` choices."""

    choices: list[_Choice]

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    @property
    def rids(self) -> list[str]:
        return [c.rid for c in self.choices]


class _QueueIO:
    """The scheduler's I/O inside `Engine`: requests in a queue, outputs collected in a list."""

    def __init__(self) -> None:
        self.inbox: deque[Any] = deque()
        self.outbox: list[Any] = []

    def recv(self, block: bool) -> list[Any]:
        messages = list(self.inbox)
        self.inbox.clear()
        return messages

    def send(self, message: Any) -> None:
        self.outbox.append(message)


class Engine:
    """`Engine(model=path, dtype="float32").chat(messages, max_tokens=16, temperature=0).text`.

    `model` is a checkpoint folder or a Hugging Face model id (`model_source`); None uses the built-in
    model (`vlm_serve.builtin`). Other keywords are the settings of `config.ENGINE_CONCERNS`
    (`chunked_prefill_size`, `schedule_policy`, `page_size`, `max_total_tokens`, ...). Sampling keywords
    are named as in the OpenAI API (`max_tokens`, `temperature`, `top_p`, `stop`, `seed`, `n`, ...);
    without `max_tokens` an answer may run to the context length, as in the server.
    """

    def __init__(self, model: str | Path | None = None, **options: Any) -> None:
        concerns = (*ENGINE_CONCERNS, DisaggregationSettings)  # (an engine may be one side of PD: the tests' loopback)
        unknown = set(options) - {f.name for concern in concerns for f in dataclasses.fields(concern)}
        if unknown:
            raise TypeError(
                f"unknown engine option(s): {', '.join(sorted(unknown))} (an Engine takes the settings of "
                f"{', '.join(c.title for c in concerns)}; the HTTP server's and multi-rank ones are `vlm-serve serve`'s)"
            )
        self.server_args = with_local_model(ServerArgs(model=None if model is None else str(model), **options))
        self.model_name = self.server_args.served_model_name
        path = Path(self.server_args.model)
        self.model_config = ModelConfig.from_pretrained(path, self.server_args.quantization)
        self.tokenizer = Tokenizer.from_pretrained(path)
        self.processor = MultimodalProcessor.from_pretrained(
            path,
            self.tokenizer,
            max_image_pixels=self.server_args.max_image_pixels,
            cache_mb=self.server_args.mm_cache_mb,
        )
        self._threads = torch.get_num_threads()  # (beside an encoder pool the runner takes fewer until shutdown)
        runner = ModelRunner(RunnerConcerns.of(self.server_args), self.model_config)
        self._io = _QueueIO()
        encoder = create_encoder(EncoderConcerns.of(self.server_args), self.model_config, runner.device)
        self.scheduler = Scheduler(SchedulerConcerns.of(self.server_args), runner, self.tokenizer, encoder, self._io)
        self.detokenizer = DetokenizerManager(self.tokenizer)
        self.default_sampling = generation_defaults(path)
        self._choices: dict[str, _Choice] = {}  # by rid, until finished
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

    def generate_processed(
        self, inputs: list[ProcessedInput], priority: int = 0, lora: str | None = None, **sampling: Any
    ) -> list[GenerateOutput]:
        """Already tokenized and preprocessed inputs, all scheduled together (through LoRA adapter `lora`,
        if named). If one fails (see the module's docstring), the others are aborted and its error is raised."""
        submissions = [self.submit(x, priority, lora=lora, **sampling) for x in inputs]
        choices = [c for s in submissions for c in s.choices]
        self._wait(choices)
        failed = next((c for c in choices if c.failed), None)
        if failed is not None:
            self._abort_and_wait(choices, "another input of the same call failed")
            raise failed.outs[-1].failure()
        return [self.result(s) for s in submissions]

    # ---- driving the scheduler yourself ------------------------------------------------------------

    def submit(
        self,
        x: ProcessedInput,
        priority: int = 0,
        bootstrap: BootstrapInfo | list[BootstrapInfo] | None = None,
        lora: str | None = None,
        **sampling: Any,
    ) -> Submission:
        """Queues one prompt and returns at once: call `step()` until `done`, then `result()`. Prompts
        submitted this way are batched continuously with everything else in flight. Bad sampling values
        raise here; a failure later (a refusal by the scheduler, an image that could not be encoded, ...)
        is raised by `result()`. `bootstrap` (one, or one per choice) makes it one side of a prefill/decode
        pair; `lora` names the LoRA adapter it runs through (None: the base model)."""
        if self.scheduler is None:
            raise RuntimeError("the engine was shut down")
        request = GenerateReqInput(x, self.sampling_params(**sampling), priority, bootstrap, lora)
        messages = request.normalize(f"req{next(self._ids)}", self.scheduler.limits)
        choices = [_Choice(m.rid) for m in messages]
        self._choices.update((c.rid, c) for c in choices)
        self._io.inbox.extend(messages)
        return Submission(choices)

    def result(self, submission: Submission) -> GenerateOutput:
        if not submission.done:
            raise ValueError("the submission has not finished yet")
        failed = next((c for c in submission.choices if c.failed), None)
        if failed is not None:
            raise failed.outs[-1].failure()
        first = submission.choices[0].outs[-1]
        return GenerateOutput(
            [c.completion() for c in submission.choices],
            first.prompt_tokens,
            max(c.outs[-1].cached_tokens for c in submission.choices),
            first.media_timings,
            submission.choices[0].outs[0].prompt_logprobs,
        )

    def load_lora(self, name: str, path: str | Path) -> None:
        """Loads the LoRA adapter in folder `path` (as peft saves it) under `name` (LoRAError naming what is
        wrong with it)."""
        self._change_lora(LoadLoRAReq(name, str(path)))

    def unload_lora(self, name: str) -> None:
        """Unloads adapter `name` (not while a request uses it)."""
        self._change_lora(UnloadLoRAReq(name))

    def _change_lora(self, message: LoadLoRAReq | UnloadLoRAReq) -> None:
        out = self.scheduler.change_lora(message)
        if not out.success:
            raise LoRAError(out.message)

    def abort(self, submission: Submission, message: str = "aborted") -> None:
        """Stops the submission's unfinished choices (they finish with "abort" at the next step)."""
        self._send_aborts(submission.choices, message)

    def _send_aborts(self, choices: list[_Choice], message: str) -> None:
        self._io.inbox.extend(AbortReq(c.rid, message) for c in choices if not c.finished)

    def step(self) -> None:
        """One iteration of the scheduler's event loop (it waits briefly when only media encoding or
        grammar compilation is under way); the outputs it produced reach their submissions."""
        if self.scheduler is None:
            raise RuntimeError("the engine was shut down")
        scheduler = self.scheduler
        scheduler.run_iteration()
        for message in self._io.outbox:
            if isinstance(message, BatchTokenIdOut):
                for out in self.detokenizer.detokenize(message).outs:
                    choice = self._choices.get(out.rid)
                    if choice is not None:
                        choice.outs.append(out)
                        if choice.finished:
                            del self._choices[out.rid]
                        if choice.failed:  # (the detokenizer may have failed it alone: the scheduler goes on)
                            self._io.inbox.append(AbortReq(out.rid, "it failed"))
        self._io.outbox.clear()
        stalled = (
            scheduler.last_batch is None
            and not scheduler.result_queue
            and not len(scheduler.encoding)
            and not scheduler.grammar_queue
            and not (scheduler.disagg is not None and len(scheduler.disagg))
            and not (scheduler.storage_prefetch is not None and len(scheduler.storage_prefetch))
        )
        if stalled and scheduler.reqs and not self._io.inbox:
            raise RuntimeError("the scheduler made no progress with requests waiting (a scheduling bug)")

    # ---- streaming ---------------------------------------------------------------------------------

    def stream(self, messages: list[dict], priority: int = 0, **sampling: Any) -> Iterator[StreamChunk]:
        """Chat with the answer arriving piece by piece. Closing the iterator early aborts the request."""
        submission = self.submit(
            self.processor.process_messages(messages, add_generation_prompt=True), priority, **sampling
        )
        try:
            while not submission.done:
                self.step()
                yield from self.new_chunks(submission)
        finally:
            self._abort_and_wait(submission.choices, "the stream was closed")

    def new_chunks(self, submission: Submission) -> list[StreamChunk]:
        """What `submission`'s choices gave since the last call, as chunks (the last with the whole answer,
        once it is done); raises the failure of a choice that failed."""
        chunks = []
        for i, choice in enumerate(submission.choices):
            if choice.failed:
                raise choice.outs[-1].failure()
            new, choice.unread = choice.outs[choice.unread :], len(choice.outs)
            chunks += [
                StreamChunk(i, out.text, list(out.new_ids), out.finish_reason)
                for out in new
                if out.text or out.new_ids or out.finish_reason
            ]
        if submission.done and chunks:
            chunks[-1].output = self.result(submission)
        return chunks

    # ---- plumbing ----------------------------------------------------------------------------------

    def sampling_params(self, **sampling: Any) -> SamplingParams:
        """OpenAI-named sampling keywords over the checkpoint's generation defaults (without max_tokens,
        max_new_tokens is None: what the context leaves, set when a prompt is submitted)."""
        return sampling_params_from_openai(self.default_sampling, sampling)

    def _wait(self, choices: list[_Choice]) -> None:
        """Steps until `choices` finish (or one fails); then, if nothing else is in flight, until the
        scheduler is idle (under overlap a batch may still be running for requests that ended)."""
        while not all(c.finished for c in choices) and not any(c.failed for c in choices):
            self.step()
        while not self._choices and not self._io.inbox and not self.scheduler.is_idle():
            self.step()

    def _abort_and_wait(self, choices: list[_Choice], message: str) -> None:
        self._send_aborts(choices, message)
        while not all(c.finished for c in choices):
            self.step()
        self._wait(choices)

    def shutdown(self) -> None:
        """Stops the forward thread and the encoder pool's processes and gives the device memory back, to
        other processes too (the next engine's encoder ranks); the engine takes no requests afterwards."""
        if self.scheduler is not None:
            on_cuda = self.scheduler.runner.device.type == "cuda"
            self.scheduler.shutdown()
            self.scheduler = None  # type: ignore[assignment]
            torch.set_num_threads(self._threads)
            if on_cuda:  # torch keeps freed blocks for this process alone until they are emptied
                gc.collect()
                torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

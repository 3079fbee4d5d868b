"""SGLang's native `POST /generate`, on the same machinery as the OpenAI endpoints.

A prompt is `text` or `input_ids`, one or a batch; `image_data` / `video_data` bring media for text
prompts, which must hold the model's placeholder for each item where the chat template puts it
(`<|vision_start|><|image_pad|><|vision_end|>`, `<|vision_start|><|video_pad|><|vision_end|>`): each
is expanded for its item as in a chat completion. `sampling_params` takes SGLang's names. The answer
is SGLang's: `{"text", "output_ids", "meta_info"}` per choice (a list for a batch or `n` > 1, prompt
by prompt), or SSE chunks with the text so far and `data: [DONE]`.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vlm_serve.errors import BadRequest
from vlm_serve.messages.backend import TokenizedGenerateReq
from vlm_serve.messages.frontend import GenerateReqInput, StrOut
from vlm_serve.multimodal.items import ProcessedInput
from vlm_serve.multimodal.processor import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, MediaInput
from vlm_serve.sampling_params import MAX_N, MAX_TOP_LOGPROBS, SEED_MAX, SEED_MIN, SamplingParams, sampling_params_over
from vlm_serve.server.openai_api import OpenAIServing, check_media_count, errors_as_events, json_logprob, sse
from vlm_serve.server.protocol import BootstrapFields, valid_stop_regex
from vlm_serve.server.tokenizer_manager import TokenizerManager

# SGLang's sampling parameter -> the OpenAI-named setting of `GenerateReqInput.sampling` (same name if absent)
# SGLang's parameters that this server takes only at their default, which is what it always does
_FIXED = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False}
# SGLang's request fields that this server has no use for: refused unless left at their default
_UNSUPPORTED = {
    "input_embeds": None, "audio_data": None, "session_params": None,
    "custom_logit_processor": None, "token_ids_logprob": None, "return_hidden_states": False,
    "return_routed_experts": False, "return_bytes": False, "return_entropy": False, "background": False,
}  # fmt: skip

MediaData = str | list[str | list[str] | None] | None


class SGLangSamplingParams(BaseModel):
    """SGLang's `sampling_params`, the ones this server supports: any other is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(128, ge=1)  # SGLang's default (the OpenAI endpoints': up to the context)
    min_new_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None  # the answer ends with the first match of one (kept in it)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    json_schema: str | None = None  # a JSON schema, as a string
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)

    _valid_stop_regex = field_validator("stop_regex")(valid_stop_regex)

    @model_validator(mode="before")
    @classmethod
    def _known_names(cls, values: Any) -> Any:
        """Unknown names and SGLang's options that this server does not offer are refused by name; the
        latter are dropped when they ask for what the server does anyway."""
        if not isinstance(values, dict):
            return values
        for name, value in values.items():
            if name in _FIXED and value != _FIXED[name]:
                raise ValueError(f"{name}={value!r} is not supported (this server always uses {_FIXED[name]!r})")
            if name not in _FIXED and name not in cls.model_fields:
                raise ValueError(f"{name!r} is not a sampling parameter this server supports")
        return {name: value for name, value in values.items() if name not in _FIXED}

    def fields(self) -> dict[str, Any]:
        """The settings as `SamplingParams` names them (None where not given): SGLang's names are its
        own but for the seed."""
        values = {name: getattr(self, name) for name in type(self).model_fields}
        values["seed"] = values.pop("sampling_seed")
        return values


class GenerateRequest(BootstrapFields):
    """The body of SGLang's `/generate` (the fields this server reads; unknown ones are ignored, as
    SGLang's server ignores them, but SGLang's features this server lacks are refused by name)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    image_data: MediaData = None  # per prompt: one item or a list; for a batch, a list of those
    video_data: MediaData = None
    sampling_params: SGLangSamplingParams = Field(default_factory=SGLangSamplingParams)
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)  # the first prompt position with logprobs; -1: none
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    return_text_in_logprobs: bool = False
    priority: int | None = None
    lora_path: str | list[str | None] | None = None  # the LoRA adapter by name: one, or one per prompt of a batch

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        """`sampling_params` over `defaults` (the checkpoint's generation config), with the log-probs
        `return_logprob` asks for (the prompt's too from `logprob_start_len`)."""
        given = self.sampling_params.fields()
        if self.return_logprob:
            given.update(logprobs=True, top_logprobs=self.top_logprobs_num)
            if self.logprob_start_len >= 0:
                given["prompt_logprobs"] = self.top_logprobs_num
        return sampling_params_over(defaults, given)

    @field_validator("sampling_params", mode="before")
    @classmethod
    def _defaults_for_null(cls, params: Any) -> Any:
        return {} if params is None else params

    @field_validator("text", "input_ids")
    @classmethod
    def _not_empty(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and (not prompt or any(p in ([], "") for p in prompt)):
            raise ValueError("must not be an empty list, nor hold an empty prompt")
        return prompt

    @model_validator(mode="after")
    def _one_form(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give either `text` or `input_ids`")
        if self.input_ids is not None and (self.image_data is not None or self.video_data is not None):
            raise ValueError("image_data and video_data go with `text`, whose placeholders show where each item goes")
        for name, default in _UNSUPPORTED.items():
            if (self.model_extra or {}).get(name, default) != default:
                raise ValueError(f"{name} is not supported by this server")
        return self

    @property
    def is_batch(self) -> bool:
        prompt = self.text if self.text is not None else self.input_ids
        return isinstance(prompt, list) and not isinstance(prompt[0], int)

    def prompts(self) -> list[str | list[int]]:
        prompt = self.text if self.text is not None else self.input_ids
        return list(prompt) if self.is_batch else [prompt]

    def media(self, field: str) -> list[list[MediaInput]]:
        """Each prompt's items of `image_data` or `video_data`, each with its place in the request
        (`image_data[1]`; in a batch, `image_data[p]` or `image_data[p][1]`)."""
        data, count = getattr(self, field), len(self.prompts())
        if data is None:
            return [[] for _ in range(count)]
        if not self.is_batch:
            if isinstance(data, str):
                return [[MediaInput(data, param=field)]]
            if not all(isinstance(item, str) for item in data):
                raise BadRequest(f"{field} of one prompt must be a string or a list of strings", field)
            return [[MediaInput(item, param=f"{field}[{k}]") for k, item in enumerate(data)]]
        if not isinstance(data, list) or len(data) != count:
            raise BadRequest(f"{field} of a batch of {count} prompts must be a list with one entry per prompt", field)
        return [
            []
            if entry is None
            else [MediaInput(entry, param=f"{field}[{p}]")]
            if isinstance(entry, str)
            else [MediaInput(item, param=f"{field}[{p}][{k}]") for k, item in enumerate(entry)]
            for p, entry in enumerate(data)
        ]

    def rids(self) -> list[str]:
        """Each prompt's request id, as `meta_info.id` reports it (a new one where none is given)."""
        count = len(self.prompts())
        if self.rid is None:
            return [uuid.uuid4().hex for _ in range(count)]
        rids = [self.rid] if isinstance(self.rid, str) else self.rid
        if len(rids) != count:
            raise BadRequest(f"rid must give one id per prompt ({count}), not {len(rids)}", "rid")
        return rids


class GenerateServing:
    """`/generate` for the model an `OpenAIServing` serves, through its TokenizerManager."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    @property
    def tm(self) -> TokenizerManager:
        return self.serving.tm

    async def generate(self, request: GenerateRequest) -> dict | list[dict] | AsyncIterator[str]:
        """SGLang's answer: a dict (one prompt, one choice) or a list, or SSE chunks when it streams."""
        lora = self.serving.check_model(request.model)
        start = time.perf_counter()
        inputs = await self._inputs(request)
        loras = self._loras(request, len(inputs), lora)
        n = request.sampling_params.n
        sampling = self.tm.sampling_params(request)
        if request.return_logprob and request.logprob_start_len >= 0:
            self._check_logprob_start(request, inputs)
        priority = request.priority or 0
        choices = [
            choice
            for x, bootstrap, lora in zip(inputs, request.bootstraps(len(inputs), n), loras)
            for choice in self.tm.normalize(GenerateReqInput(x, sampling, priority, bootstrap, lora))
        ]
        ids = [rid if n == 1 else f"{rid}-{j}" for rid in request.rids() for j in range(n)]
        answer = _Answer(self, request, choices, ids, start)
        if request.stream:
            return errors_as_events(self._stream(answer, choices))
        per_choice = await self.serving.collect(choices)
        results = [answer.result(i, outs) for i, outs in enumerate(per_choice)]
        return results if request.is_batch or n > 1 else results[0]

    def _loras(self, request: GenerateRequest, num_prompts: int, by_model: str | None) -> list[str | None]:
        """Each prompt's LoRA adapter: SGLang's `lora_path` (a loaded adapter's name), else the one `model`
        names (None: the base)."""
        names = request.lora_path if isinstance(request.lora_path, list) else [request.lora_path] * num_prompts
        if len(names) != num_prompts:
            raise BadRequest(f"lora_path has {len(names)} entries for {num_prompts} prompts", param="lora_path")
        for name in names:
            if name is not None and name not in self.serving.lora_paths:
                raise BadRequest(f"no LoRA adapter named {name!r} is loaded", param="lora_path")
        return [by_model if name is None else name for name in names]

    async def _stream(self, answer: _Answer, choices: list[TokenizedGenerateReq]) -> AsyncIterator[str]:
        """One chunk per step of a choice, with its text and ids so far (and `index` when there are
        several choices), then [DONE]."""
        per_choice: list[list[StrOut]] = [[] for _ in choices]
        async with contextlib.aclosing(self.tm.generate(choices)) as outputs:
            async for i, out in outputs:
                per_choice[i].append(out)
                if out.text or out.new_ids or out.finish_reason is not None:
                    chunk = answer.result(i, per_choice[i])
                    if len(choices) > 1:
                        chunk["index"] = i
                    yield sse(chunk)
        yield "data: [DONE]\n\n"

    async def _inputs(self, request: GenerateRequest) -> list[ProcessedInput]:
        """Each prompt's model input: token ids as given, text tokenized, text with media expanded."""
        prompts = request.prompts()
        images, videos = request.media("image_data"), request.media("video_data")
        inputs = []
        for prompt, prompt_images, prompt_videos in zip(prompts, images, videos):
            if not (prompt_images or prompt_videos):
                inputs.append(self.tm.tokenize(prompt))
                continue
            check_media_count(len(prompt_images) + len(prompt_videos), self.tm.server_args)
            _check_placeholders(prompt, IMAGE_PAD, len(prompt_images), "image_data")
            _check_placeholders(prompt, VIDEO_PAD, len(prompt_videos), "video_data")
            inputs.append(await self.tm.process_prompt(prompt, prompt_images, prompt_videos))
        return inputs

    @staticmethod
    def _check_logprob_start(request: GenerateRequest, inputs: list[ProcessedInput]) -> None:
        start, shortest = request.logprob_start_len, min(len(x.input_ids) for x in inputs)
        if start >= shortest:
            raise BadRequest(
                f"logprob_start_len={start} must be less than the prompt's length ({shortest} tokens)",
                "logprob_start_len",
            )

    def token_text(self, token_id: int) -> str:
        return self.tm.tokenizer.decode([token_id], skip_special_tokens=False)


class _Answer:
    """Builds SGLang's result of each of a request's choices (choice i reported as `ids[i]`)."""

    def __init__(
        self,
        serving: GenerateServing,
        request: GenerateRequest,
        choices: list[TokenizedGenerateReq],
        ids: list[str],
        start: float,
    ) -> None:
        self.serving, self.request, self.choices, self.ids, self.start = serving, request, choices, ids, start

    def result(self, i: int, outs: list[StrOut]) -> dict[str, Any]:
        """Choice i's text, ids and meta_info after its outputs `outs` (all of them, or those so far)."""
        output_ids = [token_id for out in outs for token_id in out.new_ids]
        last = outs[-1]
        meta_info: dict[str, Any] = {
            "id": self.ids[i],
            "finish_reason": self._finish_reason(i, last),
            "prompt_tokens": len(self.choices[i].input_ids),
            "completion_tokens": len(output_ids),
            "cached_tokens": last.cached_tokens,
        }
        if self.request.return_logprob:
            meta_info.update(self._logprobs(i, outs))
        if last.finish_reason is not None:
            meta_info["e2e_latency"] = time.perf_counter() - self.start
        if last.spec is not None:  # (SGLang's names)
            meta_info["spec_verify_ct"] = last.spec.verify_steps
            meta_info["spec_accept_length"] = last.spec.mean_accepted_length
        return {"text": "".join(out.text for out in outs), "output_ids": output_ids, "meta_info": meta_info}

    def _finish_reason(self, i: int, out: StrOut) -> dict[str, Any] | None:
        """SGLang's finish reason: `{"type": "stop", "matched": <token id, stop string or stop_regex>}`, `{"type":
        "length", "length": <max_new_tokens>}` or `{"type": "abort", "message": ...}`."""
        if out.finish_reason is None:
            return None
        if out.finish_reason == "length":
            return {"type": "length", "length": self.choices[i].sampling_params.max_new_tokens}
        if out.finish_reason == "stop":
            return {"type": "stop", "matched": out.matched_stop}
        return {"type": out.finish_reason, "message": out.message}

    def _logprobs(self, i: int, outs: list[StrOut]) -> dict[str, Any]:
        """SGLang's logprob lists: entries `[logprob, token id, text or None]`, from the prompt's
        `logprob_start_len` (the first prompt token has no logprob) and for the output."""
        top = self.request.top_logprobs_num
        ids = [token_id for out in outs for token_id in out.new_ids]
        logprobs = [lp for out in outs for lp in out.logprobs]
        result: dict[str, Any] = {"output_token_logprobs": self._entries(zip(logprobs, ids))}
        if top:
            result["output_top_logprobs"] = [self._top(alt) for out in outs for alt in out.top_logprobs]
        start = self.request.logprob_start_len
        if start < 0:
            return result
        scores = outs[0].prompt_logprobs
        prompt_ids = self.choices[i].input_ids
        if scores is None:  # not computed (the request ended before its prefill)
            scores_logprobs, scores_top = [], []
        else:
            scores_logprobs, scores_top = scores.logprobs, scores.top_logprobs
        result["input_token_logprobs"] = self._entries(zip([None, *scores_logprobs], prompt_ids))[start:]
        if top:
            result["input_top_logprobs"] = [None, *(self._top(alt) for alt in scores_top)][start:]
        return result

    def _entries(self, pairs: Any) -> list[list[Any]]:
        return [[json_logprob(logprob), token_id, self._text(token_id)] for logprob, token_id in pairs]

    def _top(self, alternatives: list[tuple[int, float]]) -> list[list[Any]]:
        best = alternatives[: self.request.top_logprobs_num]
        return [[json_logprob(logprob), token_id, self._text(token_id)] for token_id, logprob in best]

    def _text(self, token_id: int) -> str | None:
        return self.serving.token_text(token_id) if self.request.return_text_in_logprobs else None


def _check_placeholders(prompt: str, placeholder: str, count: int, field: str) -> None:
    """A text prompt names where each of its `count` images (or videos) goes with one placeholder."""
    found = prompt.count(placeholder)
    if found != count:
        raise BadRequest(
            f"{field}: the text holds {found} {placeholder} placeholder(s) for {count} item(s); write "
            f"{VISION_START}{placeholder}{VISION_END} where each goes, as the chat template does",
            field,
        )

"""OpenAI API request and response bodies (the fields this server reads and writes).

Requests are validated here: wrong types, out-of-range values and malformed content parts become a
400 with pydantic's message before anything is tokenized. Unknown top-level fields, and unknown keys
of content parts, are ignored, as vLLM and SGLang do.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from vlm_serve.errors import BadRequest
from vlm_serve.messages.backend import BootstrapInfo
from vlm_serve.sampling_params import MAX_N, MAX_TOP_LOGPROBS, OPENAI_SAMPLING_KEYS, SEED_MAX, SEED_MIN


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Content parts ignore keys they do not know, as vLLM and SGLang do: their clients send extras
# (SGLang's `modalities`, vLLM's `uuid`, SGLang's `max_dynamic_patch` in the URL object, ...).
_LENIENT = ConfigDict(extra="ignore")


class MediaURL(BaseModel):
    model_config = _LENIENT

    url: str
    detail: str | None = None


class TextPart(BaseModel):
    model_config = _LENIENT

    type: Literal["text"]
    text: str


class ImageOptions(_Strict):
    """Preprocessing overrides for images, checked against the server's caps."""

    min_pixels: int | None = Field(None, gt=0)
    max_pixels: int | None = Field(None, gt=0)


class VideoOptions(ImageOptions):
    """Preprocessing overrides for videos (the pixel bounds count the whole clip)."""

    fps: float | None = Field(None, gt=0)
    max_frames: int | None = Field(None, gt=0)


def _media_object(value: Any, info: ValidationInfo) -> Any:
    if isinstance(value, str):
        raise ValueError(f'{info.field_name} must be an object {{"url": ...}}, not a string')
    return value


class ImagePart(ImageOptions):
    model_config = _LENIENT

    type: Literal["image_url"]
    image_url: MediaURL

    _check_url = field_validator("image_url", mode="before")(_media_object)


class VideoPart(VideoOptions):
    model_config = _LENIENT

    type: Literal["video_url"]
    video_url: MediaURL

    _check_url = field_validator("video_url", mode="before")(_media_object)


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]
# a string, or a list of parts (so an error names the part at fault, not both forms)
Content = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[ContentPart], Tag("parts")],
    Discriminator(lambda value: "text" if isinstance(value, str) else "parts"),
]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool fields... reach the chat template

    role: str  # any role reaches the chat template, which decides what it accepts
    content: Content | None = None


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far of its choice


class MMProcessorKwargs(VideoOptions):
    """vLLM's `mm_processor_kwargs`: options for every image and video of a request. Flat options go to
    each modality that has them (as transformers' processors route them); `images_kwargs` /
    `videos_kwargs` hold one modality's options and win over flat ones."""

    images_kwargs: ImageOptions | None = None
    videos_kwargs: VideoOptions | None = None

    def options(self, modality: Literal["image", "video"]) -> dict[str, Any]:
        """The options of one modality, as the per-part option names."""
        if modality == "image":
            names, nested = ImageOptions.model_fields, self.images_kwargs
        else:
            names, nested = VideoOptions.model_fields, self.videos_kwargs
        flat = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        return {**flat, **(nested.model_dump(exclude_none=True) if nested is not None else {})}


class VideoIOKwargs(_Strict):
    num_frames: int | None = Field(None, gt=0)  # at most this many frames are sampled


class MediaIOKwargs(_Strict):
    """vLLM's `media_io_kwargs`: how media are loaded (`{"video": {"num_frames": N}}`)."""

    video: VideoIOKwargs | None = None


_PROMPT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message")  # not chat_template_kwargs


class ChatPrompt(BaseModel):
    """How chat messages become a prompt: shared by chat completions and /tokenize."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True  # (left out, without an error, when continuing the final message)
    continue_final_message: bool = False  # end after the last (assistant) message's text, to continue it
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the chat template
    mm_processor_kwargs: MMProcessorKwargs | None = None
    media_io_kwargs: MediaIOKwargs | None = None

    @model_validator(mode="after")
    def _one_ending(self) -> ChatPrompt:
        if self.continue_final_message:
            if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
                raise ValueError("cannot set both `continue_final_message` and `add_generation_prompt` to true")
            self.add_generation_prompt = False
            last = self.messages[-1].role
            if last != "assistant":
                raise ValueError(
                    f"`continue_final_message` continues the last message, which must be an assistant message, "
                    f"not a {last!r} one"
                )
        reserved = [k for k in _PROMPT_FIELDS if k in (self.chat_template_kwargs or {})]
        if reserved:
            raise ValueError(f"`chat_template_kwargs` cannot set {reserved[0]!r}: it is a request field of its own")
        return self

    def media_options(self) -> dict[str, dict[str, Any]]:
        """The request-wide options of each modality ("image", "video"): `mm_processor_kwargs`, then
        `media_io_kwargs` (its video `num_frames` is `max_frames`)."""
        kwargs = self.mm_processor_kwargs
        options = {modality: kwargs.options(modality) if kwargs else {} for modality in ("image", "video")}
        io = self.media_io_kwargs
        if io is not None and io.video is not None and io.video.num_frames is not None:
            options["video"]["max_frames"] = io.video.num_frames
        return options


# ---- structured output and tools ---------------------------------------------------------------------


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema_json(self) -> str | None:
        """The JSON schema answers must follow (None for plain text)."""
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("response_format of type json_schema needs a json_schema")
            return json.dumps(self.json_schema.json_schema)
        return None


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


# ---- prefill/decode disaggregation ---------------------------------------------------------------------

# each field: whether a value is valid, and what it must be (SGLang's types; the router's rooms are < 2**63)
_BOOTSTRAP_KINDS = {
    "bootstrap_host": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "bootstrap_port": (lambda v: type(v) is int and 1 <= v <= 65535, "an integer port in [1, 65535]"),
    "bootstrap_room": (lambda v: type(v) is int and 0 <= v < 2**64, "an integer in [0, 2**64)"),
}
_BOOTSTRAP_FIELDS = tuple(_BOOTSTRAP_KINDS)


class BootstrapFields(BaseModel):
    """What sglang-router's PD mode adds to a request it sends to both a prefill and a decode server:
    the prefill server's bootstrap address and a room both sides share. All three or none; each is one
    value, or a list (the router sends one entry per prompt of a batch, or one per choice of a chat
    request with `n` > 1). A colocated server accepts them and ignores them."""

    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None

    @field_validator(*_BOOTSTRAP_FIELDS, mode="before")
    @classmethod
    def _check_bootstrap(cls, value: Any, info: ValidationInfo) -> Any:
        valid, kind = _BOOTSTRAP_KINDS[info.field_name]
        values = value if isinstance(value, list) else [value]
        if value is not None and (value == [] or not all(valid(v) for v in values)):
            given = json.dumps(value)
            raise ValueError(f"must be {kind}, or a non-empty list of them (one per prompt or choice), not {given}")
        return value

    @model_validator(mode="after")
    def _all_or_none(self) -> BootstrapFields:
        given = [name for name in _BOOTSTRAP_FIELDS if getattr(self, name) is not None]
        if given and len(given) < len(_BOOTSTRAP_FIELDS):
            missing = [name for name in _BOOTSTRAP_FIELDS if name not in given]
            raise ValueError(f"{' and '.join(missing)} must be given with {' and '.join(given)} (all three or none)")
        lengths = {len(getattr(self, name)) for name in given if isinstance(getattr(self, name), list)}
        if len(lengths) > 1:
            raise ValueError("bootstrap_host, bootstrap_port and bootstrap_room lists must have the same length")
        return self

    def bootstraps(self, prompts: int, n: int) -> list[BootstrapInfo | list[BootstrapInfo] | None]:
        """Each of `prompts` prompts' `GenerateReqInput.bootstrap`. Lists hold one entry per prompt (as
        the router sends them for a batch; a prompt's choices get rooms "ROOM/j") or one per choice (as
        it sends them for a chat request with `n` > 1); single values serve one prompt, or give prompt
        k of several room "ROOM/k"."""
        if self.bootstrap_room is None:
            return [None] * prompts
        fields = [getattr(self, name) for name in _BOOTSTRAP_FIELDS]
        if not any(isinstance(value, list) for value in fields):
            host, port, room = fields
            if prompts == 1:
                return [BootstrapInfo(host, port, str(room))]
            fields = [host, port, [f"{room}/{k}" for k in range(prompts)]]
        (length,) = {len(value) for value in fields if isinstance(value, list)}  # one length: `_all_or_none`
        if length not in (prompts, prompts * n):
            raise BadRequest(
                f"the bootstrap fields give {length} entries for {prompts} prompt(s) of {n} choice(s) each: "
                "give one per prompt or one per choice",
                param="bootstrap_room",
            )
        per_entry = [value if isinstance(value, list) else [value] * length for value in fields]
        infos = [BootstrapInfo(host, port, str(room)) for host, port, room in zip(*per_entry)]
        if length == prompts:
            return infos
        return [infos[k * n : (k + 1) * n] for k in range(prompts)]


class _SamplingRequest(BootstrapFields):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)  # 0 is refused, as by OpenAI and vLLM
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    min_tokens: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    regex: str | None = None  # SGLang's structured-output extras
    ebnf: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's: alternatives per prompt token

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> _SamplingRequest:
        if self.stream and self.prompt_logprobs:  # as vLLM: 0 is accepted (and not sent)
            raise ValueError("prompt_logprobs are not available when stream=True")
        return self

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("`stream_options` can only be set when `stream` is true")
        return self

    def sampling(self) -> dict[str, Any]:
        """The OpenAI-named sampling settings of the request (None where not given)."""
        values = {name: getattr(self, name, None) for name in OPENAI_SAMPLING_KEYS}
        if self.response_format is not None:
            values["json_schema"] = self.response_format.schema_json()
        return values


class ChatCompletionRequest(_SamplingRequest, ChatPrompt):
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt (text or token ids) or a batch
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # top alternatives per token (legacy API)
    echo: bool = False  # the answers start with their prompt (and, with logprobs, its tokens' entries)

    @field_validator("prompt")
    @classmethod
    def _no_empty_list(cls, prompt: str | list) -> str | list:
        if isinstance(prompt, list) and (not prompt or any(p == [] for p in prompt)):
            raise ValueError("prompt must not be an empty list, nor hold one")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, in order: each has its own `n` choices."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


# ---- responses ---------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class MediaTokens(BaseModel):
    type: Literal["image", "video"]
    tokens: int


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    media: list[MediaTokens] = []  # tokens each image / video became, in prompt order


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # vLLM's, as in CompletionChoice


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprob(BaseModel):
    """vLLM's entry for one token at one prompt position."""

    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    matched_stop: int | str | None = None
    # vLLM's: per prompt token (None for the first) the token's and its top alternatives' entries, by id
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vlm_serve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(
    message: str, status: int, kind: str = "BadRequestError", param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """OpenAI's error shape; its `code` is the HTTP status unless the error has a code of its own."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status if code is None else code}}


# ---- tokenizer endpoints (vLLM's /tokenize and /detokenize) --------------------------------------------


class TokenizeTextRequest(BaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # accepted as vLLM's clients send it: Qwen's tokenizers add no BOS/EOS


class TokenizeChatRequest(ChatPrompt):
    """Chat messages rendered as a chat completion renders them, media placeholders included."""

    model: str | None = None


def _tokenize_form(body: Any) -> str | None:
    if isinstance(body, dict):
        return "chat" if "messages" in body else "text" if "prompt" in body else None
    return None


TokenizeRequest = Annotated[
    Annotated[TokenizeTextRequest, Tag("text")] | Annotated[TokenizeChatRequest, Tag("chat")],
    Discriminator(
        _tokenize_form, custom_error_type="prompt_or_messages", custom_error_message="send `prompt` or `messages`"
    ),
]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str

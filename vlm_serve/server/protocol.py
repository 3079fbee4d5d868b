"""OpenAI API request bodies (the fields this server reads; the answers' are in output_protocol.py).

Requests are validated here: wrong types, out-of-range values and malformed content parts become a
400 with pydantic's message before anything is tokenized. Unknown keys of content parts are ignored, as
vLLM and SGLang do, and so are unknown top-level fields, with one exception: the fields of OpenAI, vLLM
and SGLang that would change the answer and that this server does not implement are refused by name
(`UNSUPPORTED_FIELDS`, each with its reason), unless their value asks for nothing (`use_beam_search:
false`). A field that changes nothing in the answer is accepted and has no effect: OpenAI's `metadata`,
`store`, `prompt_cache_key`, `safety_identifier`, `service_tier`, `prediction` (a latency hint),
`modalities: ["text"]`, `user`; vLLM's `request_id`, `cache_salt`, `guided_decoding_backend` (there is
one backend, xgrammar), `add_special_tokens` (Qwen's tokenizers add no special tokens), `truncation_side`
(no truncation), `stream_interval`, `length_penalty: 1`; SGLang's `rid`, `routed_dp_rank`.

Structured output takes one constraint per request, in any of the peers' spellings: OpenAI's
`response_format`, vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, SGLang's `json_schema`, `regex`
and `ebnf`; two are a 400 naming both (`_SamplingRequest.constraint`), as is one with a forced tool call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from vlm_serve.errors import BadRequest
from vlm_serve.messages.backend import BootstrapInfo
from vlm_serve.sampling_params import (
    MAX_N,
    MAX_TOP_LOGPROBS,
    OPENAI_SAMPLING_KEYS,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
    check_stop_regex,
    sampling_params_from_openai,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Content parts ignore keys they do not know, as vLLM and SGLang do: their clients send extras
# (SGLang's `modalities`, SGLang's `max_dynamic_patch` in the URL object, ...).
_LENIENT = ConfigDict(extra="ignore")


class MediaURL(BaseModel):
    model_config = _LENIENT

    url: str | None = None  # None or "" only in a part with a uuid (media sent before)
    detail: str | None = None


class TextPart(BaseModel):
    model_config = _LENIENT

    type: Literal["text"]
    text: str


class RefusalPart(BaseModel):
    """OpenAI's part of an assistant message that refused (a history replayed from OpenAI): rendered as
    its text (`ChatMessage` makes it a text part)."""

    model_config = _LENIENT

    type: Literal["refusal"]
    refusal: str


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


def _url_or_uuid(part: ImagePart | VideoPart, field: str) -> None:
    """vLLM's multimodal UUIDs: a media part's url may be left out (no `field`, `null`, a null or empty
    url) when it has a `uuid` naming media sent before with it. The part then holds `{"url": ""}`, so
    the chat template still sees a media part and the processor looks the uuid up."""
    media = getattr(part, field)
    if media is not None and media.url:
        return
    if part.uuid is None:
        raise ValueError(f"this {field} part needs a {field}.url, or a uuid naming media sent before with it")
    setattr(part, field, MediaURL(url="", detail=media.detail if media is not None else None))


class ImagePart(ImageOptions):
    """An image: `image_url.url`, and/or a `uuid` (vLLM's) that names it for later requests."""

    model_config = _LENIENT

    type: Literal["image_url"]
    image_url: MediaURL | None = None
    uuid: str | None = None

    _check_url = field_validator("image_url", mode="before")(_media_object)

    @model_validator(mode="after")
    def _source(self) -> ImagePart:
        _url_or_uuid(self, "image_url")
        return self


class VideoPart(VideoOptions):
    """A video: `video_url.url` (a `data:video/jpeg;base64,<frame>,<frame>,...` URL is a list of frames,
    as vLLM takes it), and/or a `uuid` (vLLM's) that names it for later requests."""

    model_config = _LENIENT

    type: Literal["video_url"]
    video_url: MediaURL | None = None
    uuid: str | None = None

    _check_url = field_validator("video_url", mode="before")(_media_object)

    @model_validator(mode="after")
    def _source(self) -> VideoPart:
        _url_or_uuid(self, "video_url")
        return self


ContentPart = Annotated[TextPart | RefusalPart | ImagePart | VideoPart, Field(discriminator="type")]
# a string, or a list of parts (so an error names the part at fault, not both forms)
Content = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[ContentPart], Tag("parts")],
    Discriminator(lambda value: "text" if isinstance(value, str) else "parts"),
]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool fields... reach the chat template

    role: str  # any role reaches the chat template, which decides what it accepts
    content: Content | None = None

    @field_validator("content")
    @classmethod
    def _refusals_as_text(cls, content: Any) -> Any:
        if isinstance(content, list):
            return [TextPart(type="text", text=p.refusal) if isinstance(p, RefusalPart) else p for p in content]
        return content


class StreamOptions(BaseModel):
    model_config = _LENIENT  # OpenAI's newer keys (`include_obfuscation`: a stream's padding) change nothing here

    include_usage: bool = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk has its choice's usage so far

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk carries usage: only with `include_usage`, as in vLLM."""
        return self.include_usage and self.continuous_usage_stats


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

    @property
    def answer_role(self) -> str:
        """The role of the answer, as vLLM names it: the assistant's after a generation prompt, else that of
        the last message (which the answer goes on from)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

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
            return JSON_OBJECT
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("response_format of type json_schema needs a json_schema")
            return json.dumps(self.json_schema.json_schema)
        return None


class Constraint(NamedTuple):
    """What an answer must follow, and the request field that asked for it."""

    field: str  # as the client named it: "response_format", "guided_choice", ...
    kind: Literal["json_schema", "regex", "ebnf"]  # the SamplingParams field (the scheduler's grammar kinds)
    source: str


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose sentences are exactly `choices` (vLLM's `choice`): each a string literal escaped as JSON
    escapes it, which xgrammar's EBNF reads alike (quotes, backslashes, newlines, control characters)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _schema_text(schema: dict[str, Any] | str) -> str:
    """A JSON schema given as an object or as its JSON text (vLLM takes both), as JSON text."""
    return schema if isinstance(schema, str) else json.dumps(schema)


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
JSON_OBJECT = '{"type": "object"}'  # the schema of `json_object` answers: any object, as in OpenAI's JSON mode


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one constraint, `json` (a schema), `regex`, `choice` (the
    answer is one of these strings), `grammar` (EBNF) or `json_object` (any JSON object)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # either way: JSON answers here never have free whitespace
    disable_additional_properties: bool = (
        False  # either way: no properties beyond the schema's (xgrammar's strict mode)
    )
    # these two are refused unless null (UNSUPPORTED_FIELDS)
    whitespace_pattern: str | None = None
    structural_tag: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in _CONSTRAINTS if self._value(name) not in (None, False)]
        if len(given) != 1:
            found = f"not {' and '.join(given)}" if given else "none was"
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(_CONSTRAINTS)}: {found} given")
        return self

    def _value(self, name: str) -> Any:
        return self.json_ if name == "json" else getattr(self, name)

    def constraint(self) -> Constraint:
        if self.json_ is not None:
            return Constraint("structured_outputs", "json_schema", _schema_text(self.json_))
        if self.regex is not None:
            return Constraint("structured_outputs", "regex", self.regex)
        if self.choice is not None:
            return Constraint("structured_outputs", "ebnf", choice_grammar(self.choice))
        if self.grammar is not None:
            return Constraint("structured_outputs", "ebnf", self.grammar)
        return Constraint("structured_outputs", "json_schema", JSON_OBJECT)


# request fields that constrain the answer on their own: field -> (SamplingParams kind, its grammar source)
_CONSTRAINT_FIELDS = {
    "json_schema": ("json_schema", str),  # SGLang's (its text completions'): a schema's JSON text
    "regex": ("regex", str),  # SGLang's
    "ebnf": ("ebnf", str),  # SGLang's
    "guided_json": ("json_schema", _schema_text),  # vLLM's older fields
    "guided_regex": ("regex", str),
    "guided_choice": ("ebnf", choice_grammar),
    "guided_grammar": ("ebnf", str),
}


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


class AllowedTools(BaseModel):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)  # {"type": "function", "function": {"name": ...}}


class AllowedToolsChoice(BaseModel):
    """OpenAI's `{"type": "allowed_tools", "allowed_tools": {"mode": ..., "tools": [...]}}`: every tool is
    rendered, but only these may be called (`chat_output.tool_use` says how)."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools

    @property
    def names(self) -> list[str]:
        return [tool.function.name for tool in self.allowed_tools.tools]


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice


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


# ---- request fields this server refuses ----------------------------------------------------------------

_UNSET, _OFF = (None,), (None, False)
_BEAM_SEARCH = "beam search is not implemented here"
_NO_STRUCTURAL_TAG = "structural tags are not supported (response_format, structured_outputs and guided_* are)"
_NO_WHITESPACE_PATTERN = "a whitespace pattern is not supported: JSON answers here have no free whitespace"
_NO_LOGITS_PROCESSORS = "custom logits processors are not supported"
_STOP_CUT = "the matched stop string is always cut from the answer"

# The fields of OpenAI's, vLLM's and SGLang's requests that would change the answer (or add to it) and that
# this server does not implement: field (a dotted path for a key of an object field) -> (the values that
# ask for nothing beyond what the server does anyway, or a test of the value and the request; why another
# value is refused). A request giving another value is a 400 naming the field and the reason; a field
# the request model declares itself (text completions' `echo`) is its own.
UNSUPPORTED_FIELDS: dict[str, tuple[tuple[Any, ...] | Callable[[Any, dict[str, Any]], bool], str]] = {
    # vLLM's beam search
    "use_beam_search": (_OFF, _BEAM_SEARCH),
    "best_of": (
        lambda best_of, body: best_of in (None, body.get("n", 1)), "choosing the best of more candidates than `n` is not implemented",
    ),
    "length_penalty": ((None, 1), "it scores beams: " + _BEAM_SEARCH),
    "early_stopping": (_OFF, "it ends beams: " + _BEAM_SEARCH),
    # structured output
    "structural_tag": (_UNSET, _NO_STRUCTURAL_TAG),
    "structured_outputs.structural_tag": (_UNSET, _NO_STRUCTURAL_TAG),
    "structured_outputs.whitespace_pattern": (_UNSET, _NO_WHITESPACE_PATTERN),
    "guided_whitespace_pattern": (_UNSET, _NO_WHITESPACE_PATTERN),
    # sampling
    "allowed_token_ids": ((None, []), "restricting the vocabulary is not implemented (logit_bias biases tokens)"),
    "bad_words": ((None, []), "banned words are not implemented"),
    "stop_regex": ((None, []), "responses take no regex stop conditions (chat and text completions and /generate do)"),
    "thinking_token_budget": (_UNSET, "a reasoning budget is not implemented"),
    "repetition_detection": (_UNSET, "repetition detection is not implemented"),
    "watermarking": (_OFF, "watermarking is not implemented"),
    "vllm_xargs": ((None, {}), _NO_LOGITS_PROCESSORS),
    "custom_logit_processor": (_UNSET, _NO_LOGITS_PROCESSORS),
    "custom_params": ((None, {}), _NO_LOGITS_PROCESSORS),
    "lora_path": (_UNSET, "LoRA adapters are not supported"),
    # the prompt
    "truncate_prompt_tokens": (_UNSET, "prompts are not truncated (a prompt longer than the context is refused)"),
    "chat_template": (_UNSET, "a request's own chat template is not supported: the checkpoint's is used"),
    "documents": (_UNSET, "documents are not passed to the chat template"),
    "prompt_embeds": (_UNSET, "prompt embeddings are not supported"),
    "input_ids": (_UNSET, "token-id prompts go in the `prompt` of /v1/completions"),
    "suffix": ((None, ""), "text after the insertion point is not supported"),
    "echo": (_OFF, "responses do not echo their input (chat and text completions take `echo`)"),
    # the answer's text
    "skip_special_tokens": ((None, True), "special tokens are always left out of the answer's text"),
    "spaces_between_special_tokens": ((None, True), "special tokens are always left out of the answer's text"),
    "include_stop_str_in_output": (_OFF, _STOP_CUT),
    "no_stop_trim": (_OFF, _STOP_CUT),
    "include_reasoning": ((None, True), "reasoning is always returned"),
    "separate_reasoning": ((None, True), "reasoning is always separated (with --reasoning-parser)"),
    "stream_reasoning": ((None, True), "reasoning is always streamed"),
    # more than OpenAI's answer
    "return_token_ids": (_OFF, "token ids are not returned"),
    "return_prompt_token_ids": (_OFF, "token ids are not returned"),
    "return_tokens_as_token_ids": (_OFF, "tokens are returned as text"),
    "logprob_token_ids": ((None, []), "log-probs of chosen tokens are not returned (top_logprobs are)"),
    "return_hidden_states": (_OFF, "hidden states are not returned"),
    "return_meta_info": (_OFF, "SGLang's meta_info is returned by /generate only"),
    # OpenAI's
    "modalities": (lambda value, body: value is None or value in ([], ["text"]), "answers are text only"),
    "audio": (_UNSET, "audio answers are not supported"),
    "web_search_options": (_UNSET, "web search is not available"),
    "functions": ((None, []), "the deprecated `functions` are not supported: send `tools`"),
    "function_call": (_UNSET, "the deprecated `function_call` is not supported: send `tool_choice`"),
    "verbosity": ((None, "medium"), "this model has no verbosity setting"),
    # vLLM's disaggregation
    "kv_transfer_params": (_UNSET, "vLLM's KV transfer is not supported (prefill/decode servers here use sglang-router's bootstrap fields)"),
}  # fmt: skip


def refuse_unsupported(body: dict[str, Any], declared: Collection[str]) -> None:
    """Raises a 400 naming the first field of `UNSUPPORTED_FIELDS` that `body` gives a value it refuses
    (fields in `declared`, the request model's own, excepted)."""
    for name, (accepted, reason) in UNSUPPORTED_FIELDS.items():
        field, _, key = name.partition(".")
        if not key and field in declared:
            continue
        value = body.get(field)
        if key:
            value = value.get(key) if isinstance(value, dict) else None
        if not (accepted(value, body) if callable(accepted) else value in accepted):
            given = json.dumps(value, default=str)
            given = given if len(given) <= 100 else given[:100] + "..."
            raise BadRequest(f"`{name}` is not supported: {reason} (given {given})", param=name)


def valid_stop_regex(patterns: str | list[str] | None) -> str | list[str] | None:
    """A request's `stop_regex` as given, once each pattern is known to be a regular expression."""
    check_stop_regex(patterns)
    return patterns


class SamplingSettings(BaseModel):
    """The sampling settings every generating endpoint takes (OpenAI's, with vLLM's and SGLang's extras)."""

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)


class _SamplingRequest(BootstrapFields, SamplingSettings):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)  # 0 is refused, as by OpenAI and vLLM
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None  # SGLang's: the answer ends with the first match of one
    n: int = Field(1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    min_tokens: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    json_schema: str | None = None  # SGLang's structured-output extras (`_CONSTRAINT_FIELDS`)
    regex: str | None = None
    ebnf: str | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    guided_json: dict[str, Any] | str | None = None  # vLLM's older ones
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's: alternatives per prompt token

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, body: Any) -> Any:
        if isinstance(body, dict):
            refuse_unsupported(body, cls.model_fields)
        return body

    _valid_stop_regex = field_validator("stop_regex")(valid_stop_regex)

    @model_validator(mode="after")
    def _one_constraint(self) -> _SamplingRequest:
        self.constraint()
        return self

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

    def constraint(self) -> Constraint | None:
        """What the answer must follow, whichever field asked for it (None: free text). A request takes
        at most one: two are a 400 naming both."""
        found = []
        if self.response_format is not None and (schema := self.response_format.schema_json()) is not None:
            found.append(Constraint("response_format", "json_schema", schema))
        if self.structured_outputs is not None:
            found.append(self.structured_outputs.constraint())
        for name, (kind, source) in _CONSTRAINT_FIELDS.items():
            if getattr(self, name) is not None:
                found.append(Constraint(name, kind, source(getattr(self, name))))
        if len(found) > 1:
            raise BadRequest(
                f"`{found[0].field}` and `{found[1].field}` cannot both be given: an answer follows at most one "
                "constraint",
                param=found[1].field,
            )
        return found[0] if found else None

    def to_sampling_params(self, defaults: dict[str, Any], **given: Any) -> SamplingParams:
        """The request's settings over `defaults` (the checkpoint's generation config), its constraint as
        `json_schema`, `regex` or `ebnf`; `given` (OpenAI-named) are the endpoint's own. ValueError names
        a bad value."""
        values = {name: getattr(self, name, None) for name in OPENAI_SAMPLING_KEYS}
        values.update(json_schema=None, regex=None, ebnf=None)
        constraint = self.constraint()
        if constraint is not None:
            values[constraint.kind] = constraint.source
        return sampling_params_from_openai(defaults, values | given)


class ChatCompletionRequest(_SamplingRequest, ChatPrompt):
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # a chat template variable, as vLLM passes it; "none" also turns thinking off, as SGLang does
    # (`enable_thinking: false`, unless chat_template_kwargs say otherwise)
    reasoning_effort: str | None = None
    echo: bool = False  # vLLM's: the answer starts with the last message's text when that has its role

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            if isinstance(tool, dict) and tool.get("type", "function") != "function":
                raise ValueError(f"tool {i} is a {tool.get('type')!r} tool: only function tools are supported")
        return tools

    def to_sampling_params(
        self, defaults: dict[str, Any], reasoning: bool = False, tool_grammar: str | None = None
    ) -> SamplingParams:
        """As any request's, with `reasoning` (a thinking model's answer starts with its reasoning, and a
        grammar applies after it) and the grammar `tool_choice` asks for (`tool_use`'s, which is None
        where another constraint is given)."""
        tools = {} if tool_grammar is None else {"ebnf": tool_grammar}
        return super().to_sampling_params(defaults, reasoning=reasoning, **tools)

    def echoed(self) -> str:
        """What `echo` puts before the answer (as vLLM does): the last message's text (its text parts one
        per line) when that message has the answer's role, else nothing."""
        last = self.messages[-1]
        if not self.echo or last.role != self.answer_role or last.content is None:
            return ""
        if isinstance(last.content, str):
            return last.content
        return "\n".join(part.text for part in last.content if isinstance(part, TextPart))

    @model_validator(mode="after")
    def _reasoning_effort_to_template(self) -> ChatCompletionRequest:
        if self.reasoning_effort is not None:
            kwargs = {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}
            if self.reasoning_effort == "none":
                kwargs.setdefault("enable_thinking", False)
            self.chat_template_kwargs = kwargs
        return self


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

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        """As any request's, with the legacy API's integer `logprobs` (the top alternatives per token;
        with `echo`, the echoed prompt tokens get their entries too)."""
        top = self.logprobs
        echoed = max(self.prompt_logprobs or 0, top) if self.echo and top is not None else self.prompt_logprobs
        return super().to_sampling_params(
            defaults, logprobs=top is not None, top_logprobs=top or 0, prompt_logprobs=echoed
        )

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, in order: each has its own `n` choices."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


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


class LoRAAdapterRequest(_Strict):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: an adapter's name and (to load) its folder."""

    lora_name: str
    lora_path: str | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str

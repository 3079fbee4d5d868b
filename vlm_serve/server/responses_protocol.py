"""OpenAI Responses API bodies (`POST /v1/responses`): the request, its input items, and the response
object with its output items, usage and streamed events.

A request is validated here (a 400 naming the field otherwise); `responses_api` turns its input items
into chat messages, so that what is generated goes through the same path as a chat completion.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from vlm_serve.sampling_params import MAX_TOP_LOGPROBS
from vlm_serve.server.protocol import ImagePart, SamplingSettings, TextPart, VideoPart, refuse_unsupported

_LENIENT = ConfigDict(extra="ignore")  # as chat content parts: clients send keys of their own


# ---- input items ---------------------------------------------------------------------------------------


class InputText(BaseModel):
    model_config = _LENIENT

    type: Literal["input_text", "output_text"]  # (an assistant message replayed from an earlier output)
    text: str


class InputImage(BaseModel):
    """An image by URL (a data URL, or one the server may fetch), or by the `uuid` of one sent before."""

    model_config = _LENIENT

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None  # refused: this server has no Files API
    detail: str | None = None
    uuid: str | None = None


class InputFile(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["input_file"]  # refused: this server has no Files API


class Refusal(BaseModel):
    model_config = _LENIENT

    type: Literal["refusal"]
    refusal: str


# Responses' own parts, and chat completions' parts (our video shape among them)
InputPart = Annotated[
    InputText | InputImage | InputFile | Refusal | TextPart | ImagePart | VideoPart, Field(discriminator="type")
]


class MessageItem(BaseModel):
    model_config = _LENIENT

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputPart]
    id: str | None = None


class FunctionCallItem(BaseModel):
    """A call the model made (an earlier response's output, replayed)."""

    model_config = _LENIENT

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(BaseModel):
    """What a call returned, for the model's next turn."""

    model_config = _LENIENT

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None


class ReasoningInputItem(BaseModel):
    """An earlier response's reasoning, replayed: it goes with the assistant message after it."""

    model_config = _LENIENT

    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    id: str | None = None


def _item_type(value: Any) -> str:
    return (value.get("type") if isinstance(value, dict) else getattr(value, "type", None)) or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningInputItem, Tag("reasoning")],
    Discriminator(_item_type),
]


# ---- the request ---------------------------------------------------------------------------------------


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    type: Literal["function"]
    name: str


class AllowedToolsChoice(BaseModel):
    """Calls restricted to some of the tools (all are still shown to the model)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class TextFormat(BaseModel):
    model_config = _LENIENT

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    format: TextFormat = TextFormat(type="text")
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint to OpenAI's models; ours have no knob


class ReasoningConfig(BaseModel):
    model_config = _LENIENT

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


# fields OpenAI's API takes that this server cannot honour: refused rather than ignored
_REFUSED = {
    "conversation": "conversations are not stored here: use previous_response_id",
    "prompt": "stored prompt templates are not available here: send the input",
    "max_tool_calls": "max_tool_calls is not supported: use parallel_tool_calls false for at most one call",
}


class ResponsesRequest(SamplingSettings):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None  # a system message (not carried over by previous_response_id)
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] = []
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | AllowedToolsChoice = "auto"
    parallel_tool_calls: bool = True
    reasoning: ReasoningConfig | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # (include_obfuscation: nothing is obfuscated here)
    truncation: Literal["disabled"] = "disabled"  # "auto" would drop input silently: refused
    metadata: dict[str, str] | None = None
    # no effect on what is generated
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    priority: int = 0
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, body: Any) -> Any:  # (vLLM's and SGLang's extras, as in chat completions)
        if isinstance(body, dict):
            refuse_unsupported(body, cls.model_fields)
        return body

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, tool in enumerate(tools):
            kind = tool.get("type")
            if kind != "function":
                raise ValueError(f"tool {i} is of type {kind!r}: this server runs no hosted tools, only function tools")
            FunctionTool.model_validate(tool)
        return tools

    def refusals(self) -> None:
        """Raises ValueError naming a field that is set but that this server cannot honour."""
        for name, why in _REFUSED.items():
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: {why}")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise ValueError("text.verbosity: this model has no verbosity setting")
        if self.background and not self.store:
            raise ValueError("background responses need store: true (they are fetched later by id)")
        if self.background and self.stream:
            raise ValueError("a background response cannot be streamed here: poll GET /v1/responses/{id}")


# ---- the response --------------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[dict[str, Any]] | None = None


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = []


class FunctionCallOut(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOut(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = []
    content: list[ReasoningText] = []
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | FunctionCallOut | ReasoningOut


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # prompt tokens computed now (the prefix cache keeps them)
    media: list[dict[str, Any]] = []  # tokens each image / video became, in prompt order (as in chat usage)


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    code: str | None
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    model: str
    output: list[OutputItem] = []
    error: ResponseError | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = {}
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    background: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    text: dict[str, Any] = {"format": {"type": "text"}}
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = []
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool = False

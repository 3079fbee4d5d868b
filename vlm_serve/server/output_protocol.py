"""OpenAI API answer bodies: chat completions and their stream chunks, text completions, usage (with the
media and speculative details this server adds), log-probs, models, and the error shape."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel

from vlm_serve.errors import ApiError


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


class SpeculativeUsage(BaseModel):
    """Speculative decoding's share of an answer (not OpenAI's: present only when the server drafts)."""

    verify_steps: int  # decode steps that verified drafts
    draft_tokens: int
    accepted_tokens: int
    mean_accepted_length: float  # tokens per verify step, the step's own included


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    speculative: SpeculativeUsage | None = None


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
    role: str = "assistant"  # (the last message's, where there is no generation prompt: `answer_role`)
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
    role: str | None = None
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
    parent: str | None = None  # of a LoRA adapter: the base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(error: ApiError) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}

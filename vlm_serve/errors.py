"""The ways a request can fail, each with its HTTP status and OpenAI error type.

Handlers raise these (or ValueError, which is the client's fault: a 400); the app's one exception
handler turns them into OpenAI's error shape: `type` one of `ERROR_TYPES`, `code` a short string
naming the cause or null, `param` the request field at fault where one is. A failure the server caused
is never an empty success.
"""

from __future__ import annotations

# OpenAI's error types (its API reference, and the types its own servers send)
ERROR_TYPES = (
    "invalid_request_error", "authentication_error", "not_found_error", "service_unavailable_error", "server_error",
)  # fmt: skip


class ApiError(Exception):
    """A request that ends with an error: `status` and OpenAI's `type` (and `code`, `param`) say which."""

    status = 500
    kind = "server_error"
    code: str | None = None  # a class's default; an error may name its own cause

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code:
            self.code = code


class BadRequest(ApiError, ValueError):
    """The request itself is wrong (400)."""

    status = 400
    kind = "invalid_request_error"


class MediaError(BadRequest):
    """An image or video that cannot be used: unreadable, undecodable, too large or malformed (a 400;
    `param`, where set, names the request's part that holds it)."""


class ContextLengthExceeded(BadRequest):
    """A prompt and its answer cannot fit in the context: OpenAI's `context_length_exceeded`, worded as
    OpenAI and vLLM word it (LangChain and LiteLLM recognise it by the code and that wording)."""

    code = "context_length_exceeded"

    def __init__(self, limit: int, prompt_tokens: int, max_tokens: int, why: str = "") -> None:
        # "the prompt is too long" where it is: what LangChain looks for in the message (newer openai
        # clients leave the error's code out of the exception's text)
        cause = ": the prompt is too long" if prompt_tokens >= limit else ""
        super().__init__(
            f"This model's maximum context length is {limit} tokens{why}. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion)"
            f"{cause}. Please reduce the length of the messages or completion.",
            param="messages",
        )


class Unauthorized(ApiError):
    """The request lacks the server's API key (401)."""

    status = 401
    kind = "authentication_error"
    code = "invalid_api_key"


class NotFound(ApiError):
    """No such route or resource (404)."""

    status = 404
    kind = "not_found_error"


class ModelNotFoundError(NotFound, LookupError):
    """A request named a model this server does not serve: OpenAI's 404 `model_not_found`."""

    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model")


class MethodNotAllowed(ApiError):
    """The route exists, but not for this HTTP method (405)."""

    status = 405
    kind = "invalid_request_error"
    code = "method_not_allowed"


class Conflict(ApiError):
    """The server cannot do this in its present state (409), e.g. flush caches in use."""

    status = 409
    kind = "invalid_request_error"
    code = "conflict"


class ServiceUnavailable(ApiError):
    """The server accepted the request but could not serve it (e.g. no encoder rank could encode its
    media): a 503 naming the cause. The client may retry."""

    status = 503
    kind = "service_unavailable_error"


class InternalError(ApiError):
    """Something in the server failed that should not have: a 500 (the traceback goes to the log)."""

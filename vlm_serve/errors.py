"""The ways a request can fail, each with its HTTP status and OpenAI error type.

Handlers raise these (or ValueError, which is the client's fault: a 400); the app's one exception
handler turns them into OpenAI's error shape. A failure the server caused is never an empty success.
"""

from __future__ import annotations


class ApiError(Exception):
    """A request that ends with an error: `status` and OpenAI's `type` (and `code`, `param`) say which."""

    status = 500
    kind = "InternalServerError"
    code: str | int | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(ApiError, ValueError):
    """The request itself is wrong (400)."""

    status = 400
    kind = "BadRequestError"


class Unauthorized(ApiError):
    """The request lacks the server's API key (401)."""

    status = 401
    kind = "AuthenticationError"


class NotFound(ApiError):
    """No such route or resource (404)."""

    status = 404
    kind = "NotFoundError"


class ModelNotFoundError(NotFound, LookupError):
    """A request named a model this server does not serve: OpenAI's 404 `model_not_found`."""

    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model")


class MethodNotAllowed(ApiError):
    """The route exists, but not for this HTTP method (405)."""

    status = 405
    kind = "MethodNotAllowedError"


class Conflict(ApiError):
    """The server cannot do this in its present state (409), e.g. flush caches in use."""

    status = 409
    kind = "ConflictError"


class ServiceUnavailable(ApiError):
    """The server accepted the request but could not serve it (e.g. no encoder rank could encode its
    media): a 503 naming the cause. The client may retry."""

    status = 503
    kind = "ServiceUnavailableError"


class InternalError(ApiError):
    """Something in the server failed that should not have: a 500 (the traceback goes to the log)."""

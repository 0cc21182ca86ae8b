"""HTTP-facing errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Everything a client can get wrong or run into becomes an :class:`APIError` with a status code,
so handlers raise and one exception handler renders; nothing builds error JSON by hand twice.
"""

from __future__ import annotations

from typing import Any

from specdec.errors import InvalidRequestError, PromptTooLongError, SpecDecError


class APIError(SpecDecError):
    """An error response: HTTP status, OpenAI ``type``/``param``/``code``, optional headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def from_engine_error(
    err: InvalidRequestError, param_names: dict[str, str] | None = None
) -> APIError:
    """A 400 for an engine validation error, renaming the engine's parameter to the API's
    (``max_new_tokens`` is ``max_tokens`` on the wire)."""
    param = err.param
    if param is not None and param_names:
        param = param_names.get(param, param)
    code = "context_length_exceeded" if isinstance(err, PromptTooLongError) else "invalid_value"
    if param in ("max_tokens", "max_completion_tokens") and "context" in str(err):
        code = "context_length_exceeded"
    return APIError(400, str(err), param=param, code=code)


def queue_full(retry_after: int) -> APIError:
    return APIError(
        429,
        "the server is busy: its request queue is full; retry after the Retry-After delay",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after)},
    )


def queue_timeout(retry_after: int) -> APIError:
    return APIError(
        503,
        "the request waited in the queue longer than the server's request timeout; retry later",
        type="server_error",
        code="request_timeout",
        headers={"Retry-After": str(retry_after)},
    )


def decode_timeout() -> APIError:
    return APIError(
        504,
        "generation exceeded the server's request timeout; ask for fewer max_tokens",
        type="server_error",
        code="request_timeout",
    )


def shutting_down() -> APIError:
    return APIError(
        503,
        "the server is shutting down",
        type="server_error",
        code="shutting_down",
        headers={"Retry-After": "5"},
    )


def internal(message: str = "internal error while generating; see the server log") -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")

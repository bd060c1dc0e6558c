"""How ``chunkcache serve`` turns failures into OpenAI-shaped JSON errors.

=========================================  ======  ====================================
failure                                    status  error type (code)
=========================================  ======  ====================================
bad body, bad policy, empty messages, a    400     invalid_request_error
bad seed, text with a lone surrogate
max_tokens over ``max_tokens_limit``       400     invalid_request_error (max_tokens_too_large)
prompt over ``max_prompt_chars``, or       400     invalid_request_error (prompt_too_long)
(plus max_tokens) over the context window,
or leaving no room to generate
missing or wrong API key                   401     authentication_error (invalid_api_key)
another model than the one served          404     invalid_request_error (model_not_found)
body larger than ``max_body_bytes``        413     invalid_request_error (body_too_large)
queue full                                 429     rate_limit_error (queue_full), Retry-After
shutting down                              503     service_unavailable (shutting_down)
the engine stopped or failed               503     service_unavailable (backend_unavailable)
anything else (logged)                     500     server_error
=========================================  ======  ====================================
"""

from __future__ import annotations

import logging
import math

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from chunkcache.core.errors import (
    BackendUnavailableError,
    ChunkCacheError,
    PromptTooLongError,
    QueueFullError,
    ShuttingDownError,
)
from chunkcache.core.serve.schemas import error_body

log = logging.getLogger("chunkcache.serve")


class ServeError(Exception):
    """A failure with its HTTP status, OpenAI error type and code."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.code = code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(str(self), self.type, self.code), self.status, headers=self.headers
        )


def serve_error(error: BaseException) -> ServeError:
    """The :class:`ServeError` for ``error`` (unexpected ones are logged, status 500)."""
    if isinstance(error, ServeError):
        return error
    if isinstance(error, QueueFullError):
        retry = str(max(1, math.ceil(error.retry_after_s)))
        return ServeError(429, str(error), "rate_limit_error", "queue_full", {"Retry-After": retry})
    if isinstance(error, ShuttingDownError):
        return ServeError(503, str(error), "service_unavailable", "shutting_down")
    if isinstance(error, BackendUnavailableError):
        log.error("chunkcache serve: the engine failed", exc_info=error)
        return ServeError(503, str(error), "service_unavailable", "backend_unavailable")
    if isinstance(error, PromptTooLongError):
        return ServeError(400, str(error), code="prompt_too_long")
    # InvalidChunkError, bad policy or sampling values: the caller's input.
    if isinstance(error, ChunkCacheError | ValueError | TypeError):
        return ServeError(400, str(error))
    log.error("chunkcache serve: request failed", exc_info=error)
    return ServeError(500, f"internal error: {type(error).__name__}", "server_error")


async def handle_error(request: Request, error: Exception) -> JSONResponse:
    """Exception handler for every error a route lets through."""
    return serve_error(error).response()


async def handle_validation_error(request: Request, error: Exception) -> JSONResponse:
    """A body that does not parse or validate is a 400, as OpenAI answers, not a 422."""
    assert isinstance(error, RequestValidationError)
    parts = []
    for item in error.errors()[:5]:
        where = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
        parts.append(f"{where}: {item.get('msg', 'invalid')}" if where else item.get("msg", ""))
    return ServeError(400, "; ".join(parts) or "invalid request").response()

"""How ``chunkcache serve`` turns failures into OpenAI-shaped JSON errors.

=========================================  ======  ====================================
failure                                    status  error type (code)
=========================================  ======  ====================================
bad body, bad policy, empty messages, a    400     invalid_request_error
bad seed, text with a lone surrogate,
messages the chat template refuses, a
ChunkCacheError or ValueError (a plain
ValueError logged: it may be a bug)
max_tokens over ``max_tokens_limit``       400     invalid_request_error (max_tokens_too_large)
prompt over ``max_prompt_chars``, or       400     invalid_request_error (prompt_too_long)
(plus max_tokens) over the context window,
or leaving no room to generate
a prompt with no tokens, text the model    400     invalid_request_error (empty_prompt,
cannot read, a bad conversation id, as             invalid_text,
the backend refuses them                           invalid_conversation_id)
missing or wrong API key                   401     authentication_error (invalid_api_key)
another model than the one served          404     invalid_request_error (model_not_found)
body larger than ``max_body_bytes``        413     invalid_request_error (body_too_large)
queue full                                 429     rate_limit_error (queue_full), Retry-After
shutting down                              503     service_unavailable (shutting_down)
the engine stopped or failed               503     service_unavailable (backend_unavailable)
anything else, a TypeError too (logged)    500     server_error
=========================================  ======  ====================================

A 400 names the request field at fault in the error's ``param`` when there is one
(``messages[0].content[1]``, ``tools``, ``max_completion_tokens``...).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from chunkcache.core.errors import (
    BackendUnavailableError,
    ChunkCacheError,
    EmptyPromptError,
    InvalidConversationIdError,
    InvalidTextError,
    PromptTooLongError,
    QueueFullError,
    ShuttingDownError,
)
from chunkcache.core.serve.schemas import error_body

log = logging.getLogger("chunkcache.serve")
# The refusals whose code lets HttpBackend raise the error the local backends raise.
REFUSAL_CODES: tuple[tuple[type[ChunkCacheError], str], ...] = (
    (PromptTooLongError, "prompt_too_long"),
    (EmptyPromptError, "empty_prompt"),
    (InvalidTextError, "invalid_text"),
    (InvalidConversationIdError, "invalid_conversation_id"),
)


class ServeError(Exception):
    """A failure with its HTTP status, OpenAI error type and code."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.code = code
        self.headers = headers or {}
        self.param = param

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(str(self), self.type, self.code, self.param),
            self.status,
            headers=self.headers,
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
    if isinstance(error, ChunkCacheError):  # InvalidChunkError, InvalidTextError...: refusals
        codes = (code for kind, code in REFUSAL_CODES if isinstance(error, kind))
        return ServeError(400, str(error), code=next(codes, None))
    if isinstance(error, ValueError):
        # The library's way to refuse input (bad sampling values, a prompt with no tokens)
        # but a bug's too: answered as a refusal, logged so a bug does not go unseen.
        log.warning("chunkcache serve: a ValueError answered as a 400", exc_info=error)
        return ServeError(400, str(error))
    # A TypeError too: the body was validated, so a wrong type is the server's own bug.
    log.error("chunkcache serve: request failed", exc_info=error)
    return ServeError(500, f"internal error: {type(error).__name__}", "server_error")


def template_refusal(error: Exception) -> ServeError | None:
    """The 400 for a chat template that refuses the messages (its ``raise_exception``, e.g.
    on a system message where it has no system role, or on turns that do not alternate), or
    None.  A template that does not parse is the server's fault: not a 400."""
    try:
        from jinja2 import TemplateError, TemplateSyntaxError
    except ImportError:  # no jinja2, no chat template raised it
        return None
    if not isinstance(error, TemplateError) or isinstance(error, TemplateSyntaxError):
        return None
    return ServeError(
        400, f"the model's chat template refuses these messages: {error}", param="messages"
    )


async def handle_error(request: Request, error: Exception) -> JSONResponse:
    """Exception handler for every error a route lets through."""
    return serve_error(error).response()


async def handle_validation_error(request: Request, error: Exception) -> JSONResponse:
    """A body that does not parse or validate is a 400, as OpenAI answers, not a 422."""
    assert isinstance(error, RequestValidationError)
    content_type = request.headers.get("content-type", "")
    if not _is_json(content_type):  # FastAPI reads no such body: say why, not what is missing
        message = f"send the body as JSON with Content-Type: application/json, got {content_type!r}"
        return ServeError(400, message).response()
    items = error.errors()
    if items and items[0].get("type") == "json_invalid":
        return ServeError(400, _not_json(items[0])).response()
    parts = []
    for item in items[:5]:
        where = _location(item)
        message = str(item.get("msg", "invalid")).removeprefix("Value error, ")  # pydantic's
        parts.append(f"{where}: {message}" if where else message)
    param = _param(items[0]) if items else None
    return ServeError(400, "; ".join(parts) or "invalid request", param=param).response()


def _not_json(item: dict[str, Any]) -> str:
    """FastAPI's error for a body that does not decode: its ``loc`` ends with the character
    where decoding failed, not a field (no ``param`` for it)."""
    reason = (item.get("ctx") or {}).get("error", "JSON decode error")
    return f"the body is not valid JSON: {reason} at character {item['loc'][-1]}"


def _is_json(content_type: str) -> bool:
    """Whether a Content-Type is JSON's: ``application/json`` or a ``+json`` type."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def _param(item: dict[str, Any]) -> str | None:
    """The request field a validation error is about: its own ``param`` (a body-wide check
    names the field it refuses), else where it is."""
    ctx = item.get("ctx") or {}
    return str(ctx["param"]) if "param" in ctx else _location(item)


def _location(item: dict[str, Any]) -> str | None:
    """Where in the body a validation error is, as OpenAI names it: ``messages[0].content``."""
    path = ""
    for i, part in enumerate(item.get("loc", ())):
        if isinstance(part, int):
            path += f"[{part}]"
        elif i == 0 and part == "body":
            continue
        elif isinstance(part, str) and part.isidentifier():
            path += f".{part}" if path else part
        else:  # a union's branch, e.g. "function-after[check_unicode(), str]"
            break
    return path or None

"""ASGI middleware of ``chunkcache serve``: a body-size limit, response counting, request ids.

A body over ``max_bytes`` (by ``Content-Length``, or counted as it streams in) is
answered 413 before the route parses it.  Every response's status is counted in
:class:`ServeMetrics`; an ``X-Request-Id`` header is echoed back, so a client can tell
its requests' answers apart (the load test checks none is lost or answered twice).
An unexpected error is answered here too (a logged 500), so it is counted and echoed like
any other answer: Starlette's own 500 handler sits outside every middleware.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chunkcache.core.serve.errors import serve_error
from chunkcache.core.serve.metrics import ServeMetrics
from chunkcache.core.serve.schemas import error_body

REQUEST_ID = b"x-request-id"


class ServeMiddleware:
    """Limits body size, counts responses by path and status, echoes ``X-Request-Id``."""

    def __init__(self, app: ASGIApp, metrics: ServeMetrics, max_bytes: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        path = scope["path"] if scope["path"] in KNOWN_PATHS else "other"
        status: list[int] = []
        echo = [(REQUEST_ID, headers[REQUEST_ID][:128])] if REQUEST_ID in headers else []
        too_large = [False]

        async def send_counted(message: Message) -> None:
            if too_large[0]:  # the body overflowed while the app read it: answer 413 instead
                if not status:
                    status.append(413)
                    await self._too_large(send, echo)
                return
            if message["type"] == "http.response.start":
                status.append(message["status"])
                message = {**message, "headers": [*message.get("headers", []), *echo]}
            await send(message)

        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            too_large[0] = True
            await send_counted({})
        else:
            try:
                await self.app(scope, self._limited(receive, too_large), send_counted)
            except Exception as error:
                if status:  # the answer started: too late for another
                    raise
                await serve_error(error).response()(scope, receive, send_counted)
        if status:
            self.metrics.response(path, status[0])

    def _limited(self, receive: Receive, too_large: list[bool]) -> Receive:
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    too_large[0] = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        return limited

    async def _too_large(self, send: Send, echo: list[Any]) -> None:
        message = f"request body larger than {self.max_bytes} bytes"
        body = json.dumps(error_body(message, "invalid_request_error", "body_too_large")).encode()
        headers: list[Any] = [(b"content-type", b"application/json")]
        headers += [(b"content-length", str(len(body)).encode()), *echo]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


KNOWN_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/chunks",
        "/v1/chunkcache/render",
        "/health",
        "/metrics",
    }
)

"""Server-sent events for streamed completions, framed as OpenAI streams them.

Each event is ``data: <json>\\n\\n``; the stream ends with ``data: [DONE]``.  The text
arrives in chunks as it is decoded, then a chunk with ``finish_reason`` and the text the
backend held back to the end (for a stop string, or a character's last bytes; often none),
then (with ``stream_options.include_usage``, when the others carry ``"usage": null``) a chunk
with no choices and the usage.  So each chunk is one piece of the backend's stream, and a
client tells the last one (the one with the stats) as it comes.  A failure after the
response started is sent as an ``{"error": ...}`` event and ends the stream.

A stream whose client stops taking it is cut after ``SEND_STALL_S``: uvicorn's writes have
no timeout, so a client that stops reading without closing its connection would hold its
admission place, and its engine job, for as long as the connection lives.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Message, Send

from chunkcache.core.generation import GenerationChunk
from chunkcache.core.serve.errors import serve_error
from chunkcache.core.serve.responses import Reply
from chunkcache.core.serve.schemas import error_body

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# nginx's send_timeout.  A write waits only once the socket's buffers and uvicorn's 64 KB are
# full, until the client took 48 KB: a client reading at all does that well within it.
SEND_STALL_S = 60.0

log = logging.getLogger("chunkcache.serve")


def frame(data: dict[str, Any]) -> bytes:
    """One SSE event carrying ``data`` as JSON."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def sse_events(
    reply: Reply, pieces: AsyncGenerator[GenerationChunk], include_usage: bool
) -> AsyncGenerator[bytes]:
    """The SSE body for a stream of generation pieces; closes ``pieces`` when done or
    when the client goes away (the backend's generator is closed with it)."""
    # OpenAI: with include_usage, "all other chunks will also include a usage field, but
    # with a null value"
    blank = {"usage": None} if include_usage else {}
    first = True
    try:
        async for piece in pieces:
            if piece.stats is not None:
                last = reply.chunk(piece.text, piece.stats.finish_reason, first=first)
                yield frame({**last, **blank})
                if include_usage:
                    yield frame(reply.usage_chunk(piece.stats))
            elif piece.text or first:
                yield frame({**reply.chunk(piece.text, first=first), **blank})
            first = False
        yield DONE
    except Exception as error:
        failure = serve_error(error)
        yield frame(error_body(str(failure), failure.type, failure.code))
    finally:
        await pieces.aclose()


class _Stalled(Exception):
    """One write of the stream waited ``SEND_STALL_S`` for the client to read."""


class SSEResponse(StreamingResponse):
    """An SSE stream, cut (its events closed, so its generation is cancelled) when one write
    waits on the client for ``SEND_STALL_S``; uvicorn then logs the response unfinished and
    closes the connection."""

    def __init__(self, events: AsyncGenerator[bytes]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.events = events

    async def stream_response(self, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            with anyio.move_on_after(SEND_STALL_S) as waited:
                await send(message)
            if waited.cancelled_caught:
                raise _Stalled

        try:
            await super().stream_response(timed_send)
        except _Stalled:
            log.warning(
                "chunkcache serve: a client stopped reading its stream for %s s: cut",
                SEND_STALL_S,
            )
        finally:
            await self.events.aclose()

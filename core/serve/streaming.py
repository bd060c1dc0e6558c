"""Server-sent events for streamed completions, framed as OpenAI streams them.

Each event is ``data: <json>\\n\\n``; the stream ends with ``data: [DONE]``.  The text
arrives in chunks as it is decoded, then a chunk with ``finish_reason``, then (with
``stream_options.include_usage``, when the others carry ``"usage": null``) a chunk with no
choices and the usage.  A failure after
the response started is sent as an ``{"error": ...}`` event and ends the stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

from chunkcache.core.generation import GenerationChunk
from chunkcache.core.serve.errors import serve_error
from chunkcache.core.serve.responses import Reply
from chunkcache.core.serve.schemas import error_body

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
            if piece.text or first:
                yield frame({**reply.chunk(piece.text, first=first), **blank})
                first = False
            if piece.stats is not None:
                yield frame({**reply.chunk("", piece.stats.finish_reason), **blank})
                if include_usage:
                    yield frame(reply.usage_chunk(piece.stats))
        yield DONE
    except Exception as error:
        failure = serve_error(error)
        yield frame(error_body(str(failure), failure.type, failure.code))
    finally:
        await pieces.aclose()

"""One completion request end to end: admit, prepare, run through the :class:`Runner`, answer
whole as JSON or streamed as SSE, and stop the engine's work as soon as the client goes away.

A client that disconnects while its request waits (queued, in prefill, or between pieces of a
non-streamed answer) is noticed by a watcher on the ASGI ``receive`` channel, which cancels
the work: the runner cancels the backend's job, and the response is a 499 nobody reads.
Once an SSE stream started, Starlette itself watches for the disconnect and cancels the
stream's generator, which closes the generation the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from chunkcache.core.generation import GenerationRequest as EngineRequest
from chunkcache.core.generation import GenerationStats
from chunkcache.core.serve.responses import Kind, Reply
from chunkcache.core.serve.runner import Ticket
from chunkcache.core.serve.schemas import GenerationBody
from chunkcache.core.serve.state import ServeState
from chunkcache.core.serve.streaming import SSEResponse, sse_events

T = TypeVar("T")
CLIENT_GONE = 499  # nginx's "client closed request": logged and counted, never read


async def generate(
    state: ServeState,
    kind: Kind,
    body: GenerationBody,
    request: Request,
    prepare: Callable[[], EngineRequest],
) -> Response:
    """Run one completion: streamed as SSE, or whole as JSON.  A full queue or a shutdown
    refuses it before any work on it (``prepare``: the chat template, segmenting)."""
    ticket = state.runner.admit()
    try:
        engine_request = await anyio.to_thread.run_sync(prepare)  # CPU, in a thread
    except BaseException:
        ticket.withdraw()
        raise
    reply = Reply(kind, state.model_name)
    if body.stream:
        # refusals and bad input raise here, before the stream starts
        pieces = await unless_disconnected(request, state.runner.open(engine_request, ticket))
        if pieces is None:
            ticket.release()  # cancelled, also when the runner never started on it
            return Response(status_code=CLIENT_GONE)
        return SSEResponse(sse_events(reply, pieces, body.include_usage()))
    whole = await unless_disconnected(request, _whole(state, engine_request, ticket))
    if whole is None:
        ticket.release()
        return Response(status_code=CLIENT_GONE)
    return JSONResponse(reply.whole(*whole))


async def _whole(
    state: ServeState, request: EngineRequest, ticket: Ticket
) -> tuple[str, GenerationStats]:
    """The whole text and the stats of ``request``, admitted with ``ticket``."""
    pieces = await state.runner.open(request, ticket)
    texts, stats = [], None
    try:
        async for piece in pieces:
            texts.append(piece.text)
            stats = piece.stats
    finally:
        await pieces.aclose()
    assert stats is not None  # the runner checks that the last piece carries stats
    return "".join(texts), stats


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """``work``'s result, or None when the client disconnected first (``work`` is then
    cancelled and has finished its cleanup)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
    if task.cancelled():
        return None
    return task.result()


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the request body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass

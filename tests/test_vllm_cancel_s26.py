"""A caller that stops reading a ``VllmBackend`` stream (cancels the task reading it through
``arun_stream``, or closes it from another thread) closes its request at once, not when vLLM's
next event arrives: vLLM then sees the client go and aborts the request.  A fake vLLM over
uvicorn holds every event until the test lets it through, and reports the disconnect."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from chunkcache.core.generation import GenerationChunk, GenerationRequest
from chunkcache.core.prompting import arun_stream
from chunkcache.core.segmenter import TextSegment
from chunkcache.core.serve.launcher import serve_app
from chunkcache.integrations.vllm import VllmBackend

WAIT_S = 30.0
TOKENS = 50


class PacedVllm:
    """vLLM's streamed ``/v1/completions``, each event held until a ``steps`` permit; like
    vLLM it watches for the client leaving while it waits, and then sets ``left``."""

    def __init__(self) -> None:
        self.steps = threading.Semaphore(0)
        self.started, self.left = threading.Event(), threading.Event()

    async def completions(self, request: Request) -> Response:
        return StreamingResponse(self._events(request), media_type="text/event-stream")

    async def _events(self, request: Request) -> AsyncIterator[str]:
        self.started.set()
        try:
            for _ in range(TOKENS):
                if not await self._permit(request):
                    return
                choice = {"index": 0, "text": " w", "finish_reason": None}
                yield f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n"
            usage = {"prompt_tokens": 3, "completion_tokens": TOKENS}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"
        except asyncio.CancelledError:  # Starlette's own watch saw the client leave
            self.left.set()
            raise

    async def _permit(self, request: Request) -> bool:
        """Whether the next event may go: False once the client left (or nobody let it)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if await request.is_disconnected():
                self.left.set()
                return False
            if self.steps.acquire(blocking=False):
                return True
            await asyncio.sleep(0.01)
        return False


@pytest.fixture
def vllm() -> Iterator[tuple[str, PacedVllm]]:
    fake = PacedVllm()

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    routes = [
        Route("/health", health),
        Route("/v1/completions", fake.completions, methods=["POST"]),
    ]  # no /v1/models: a server that names no window
    with serve_app(Starlette(routes=routes)) as url:
        yield url, fake


class WatchedStream(Iterator[GenerationChunk]):
    """A backend's stream that tells when its ``nth`` piece is asked for: from then on the
    reading thread waits inside the stream, where cancelling the task cannot stop it."""

    def __init__(self, inner: Iterator[GenerationChunk], nth: int) -> None:
        self.inner, self.nth, self.calls = inner, nth, 0
        self.waiting = threading.Event()

    def __next__(self) -> GenerationChunk:
        self.calls += 1
        if self.calls == self.nth:
            self.waiting.set()
        return next(self.inner)

    def __getattr__(self, name: str) -> Any:  # cancel and close, if the stream has them
        return getattr(self.inner, name)


class WatchedBackend:
    """A :class:`VllmBackend` whose streams are watched from their ``nth`` piece."""

    def __init__(self, inner: VllmBackend, nth: int) -> None:
        self.inner, self.nth = inner, nth
        self.streams: list[WatchedStream] = []

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        return self.inner.render_chat(messages)

    def stream(self, request: GenerationRequest) -> WatchedStream:
        self.streams.append(WatchedStream(self.inner.stream(request), self.nth))
        return self.streams[-1]


def backend(url: str) -> VllmBackend:
    return VllmBackend(url, "smol", tokenizer=object(), timeout_s=120)


def request() -> GenerationRequest:
    return GenerationRequest([TextSegment("w1 w2 w3")], policy="prefix")


async def wait(event: threading.Event) -> bool:
    return await asyncio.to_thread(event.wait, WAIT_S)


async def test_cancelling_the_task_before_the_first_event_closes_the_request(
    vllm: tuple[str, PacedVllm],
) -> None:
    url, fake = vllm
    vllm_backend = backend(url)
    task = asyncio.create_task(anext(arun_stream(vllm_backend, request())))
    assert await wait(fake.started)  # vLLM holds the request (queued, or in prefill)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait(fake.left), "the request stayed open until vLLM's next event"
    vllm_backend.close()


async def test_cancelling_the_task_mid_stream_closes_the_request(
    vllm: tuple[str, PacedVllm],
) -> None:
    url, fake = vllm
    watched = WatchedBackend(backend(url), nth=2)
    pieces: list[GenerationChunk] = []

    async def read() -> None:
        async for piece in arun_stream(watched, request()):
            pieces.append(piece)

    fake.steps.release()
    task = asyncio.create_task(read())
    assert await wait(fake.started)
    while not watched.streams:
        await asyncio.sleep(0.01)
    assert await wait(watched.streams[0].waiting)  # the worker waits for the second event
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait(fake.left), "the request stayed open until vLLM's next event"
    assert [p.text for p in pieces] == [" w"]
    watched.inner.close()


@pytest.mark.parametrize("events", [0, 1])
def test_closing_the_stream_from_another_thread_while_it_waits(
    vllm: tuple[str, PacedVllm], events: int
) -> None:
    url, fake = vllm
    vllm_backend = backend(url)
    for _ in range(events):
        fake.steps.release()
    stream = WatchedStream(vllm_backend.stream(request()), nth=events + 1)
    pieces: list[GenerationChunk] = []
    failures: list[BaseException] = []

    def read() -> None:
        try:
            pieces.extend(stream)
        except BaseException as error:  # reported by the test's thread
            failures.append(error)

    reader = threading.Thread(target=read)
    reader.start()
    assert stream.waiting.wait(WAIT_S) and fake.started.wait(WAIT_S)
    stream.close()
    assert fake.left.wait(WAIT_S), "the request stayed open until vLLM's next event"
    reader.join(WAIT_S)
    assert not reader.is_alive() and not failures
    assert [p.text for p in pieces] == [" w"] * events  # it just ended
    vllm_backend.close()

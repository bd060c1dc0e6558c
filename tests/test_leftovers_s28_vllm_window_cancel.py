"""A caller that stops a ``VllmBackend`` stream (closes it from another thread, or cancels the
task reading it through ``arun_stream``) while the backend still asks vLLM for its context
window (the first ``GET /v1/models``) closes that request at once, as it would the completion:
the reading thread does not wait for the server's answer or the HTTP timeout.  A backend given
a ``transport`` of its own is cut the same way.  A fake vLLM over uvicorn holds its answers
until the test lets them through, and reports the client leaving."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from chunkcache.core.generation import GenerationChunk, GenerationRequest
from chunkcache.core.prompting import arun_stream, generate
from chunkcache.core.segmenter import TextSegment
from chunkcache.core.serve.launcher import serve_app
from chunkcache.integrations.vllm import VllmBackend

WAIT_S = 20.0


class WordTokenizer:
    def encode(self, text: str, add_special_tokens: bool) -> list[str]:
        return text.split()


class HeldVllm:
    """vLLM's ``/v1/models`` and streamed ``/v1/completions``, each answer held until the
    test gives a permit; it watches for the client leaving meanwhile, as vLLM does."""

    def __init__(self) -> None:
        self.models_permits = threading.Semaphore(0)
        self.models_asked, self.models_left = threading.Event(), threading.Event()
        self.completion_permits = threading.Semaphore(0)
        self.completion_asked, self.completion_left = threading.Event(), threading.Event()

    async def models(self, request: Request) -> Response:
        self.models_asked.set()
        if not await _permitted(request, self.models_permits, self.models_left):
            return Response(status_code=503)
        return JSONResponse({"data": [{"id": "smol", "max_model_len": 8192}]})

    async def completions(self, request: Request) -> Response:
        return StreamingResponse(self._events(request), media_type="text/event-stream")

    async def _events(self, request: Request) -> AsyncIterator[str]:
        self.completion_asked.set()
        try:
            if await _permitted(request, self.completion_permits, self.completion_left):
                choice = {"index": 0, "text": "ok", "finish_reason": "stop"}
                usage = {"prompt_tokens": 3, "completion_tokens": 1}
                for event in ({"choices": [choice]}, {"choices": [], "usage": usage}):
                    yield f"data: {json.dumps(event)}\n\n"
                yield "data: [DONE]\n\n"
        except asyncio.CancelledError:  # Starlette's own watch saw the client leave
            self.completion_left.set()
            raise


async def _permitted(request: Request, permits: threading.Semaphore, left: threading.Event) -> bool:
    """Whether a permit came before the client left (then ``left`` is set) or time ran out."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if await request.is_disconnected():
            left.set()
            return False
        if permits.acquire(blocking=False):
            return True
        await asyncio.sleep(0.01)
    return False


@pytest.fixture
def vllm() -> Iterator[tuple[str, HeldVllm]]:
    fake = HeldVllm()

    async def health(request: Request) -> Response:
        return Response()

    routes = [
        Route("/health", health),
        Route("/v1/models", fake.models),
        Route("/v1/completions", fake.completions, methods=["POST"]),
    ]
    with serve_app(Starlette(routes=routes)) as url:
        yield url, fake


TRANSPORTS = {"default": lambda: None, "own transport": lambda: httpx.HTTPTransport()}


def backend(url: str, transport: str) -> VllmBackend:
    return VllmBackend(
        url,
        "smol",
        tokenizer=WordTokenizer(),
        timeout_s=120,
        transport=TRANSPORTS[transport](),
    )


def request() -> GenerationRequest:
    return GenerationRequest([TextSegment("w1 w2 w3")], policy="prefix")


def read_in_thread(stream: Iterator[GenerationChunk]) -> tuple[threading.Thread, list[Any]]:
    """Read ``stream`` to its end in a thread: the thread, and the pieces or the error."""
    got: list[Any] = []

    def read() -> None:
        try:
            got.extend(stream)
        except BaseException as error:  # reported by the test's thread
            got.append(error)

    reader = threading.Thread(target=read)
    reader.start()
    return reader, got


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_closing_the_stream_while_the_window_is_asked_closes_that_request(
    vllm: tuple[str, HeldVllm], transport: str
) -> None:
    url, fake = vllm
    vllm_backend = backend(url, transport)
    stream = vllm_backend.stream(request())
    reader, got = read_in_thread(stream)
    assert fake.models_asked.wait(WAIT_S)
    stream.close()
    assert fake.models_left.wait(WAIT_S), "GET /v1/models stayed open until vLLM answered"
    reader.join(WAIT_S)
    assert not reader.is_alive()
    assert got == []  # it just ended
    assert not fake.completion_asked.is_set()
    vllm_backend.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_cancelling_the_task_while_the_window_is_asked_closes_that_request(
    vllm: tuple[str, HeldVllm], transport: str
) -> None:
    url, fake = vllm
    vllm_backend = backend(url, transport)
    task = asyncio.create_task(anext(arun_stream(vllm_backend, request())))
    assert await asyncio.to_thread(fake.models_asked.wait, WAIT_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(fake.models_left.wait, WAIT_S), (
        "GET /v1/models stayed open until vLLM answered"
    )
    vllm_backend.close()


@pytest.mark.filterwarnings("ignore:vLLM at .* does not report cached prompt tokens")
@pytest.mark.parametrize("before", ["window read", "a whole request"])
def test_completions_on_the_callers_own_transport_are_cut_too(
    vllm: tuple[str, HeldVllm], before: str
) -> None:
    """No request leaves a pooled connection for the next to go out on, where the stream
    would not learn its socket: not the window's GET (read as LlamaIndex reads it, before any
    stream), nor a completion."""
    url, fake = vllm
    vllm_backend = backend(url, "own transport")
    fake.models_permits.release()
    if before == "window read":
        assert vllm_backend.context_window == 8192
    else:
        fake.completion_permits.release()
        assert generate(vllm_backend, request())[0] == "ok"
        fake.completion_asked.clear()
    stream = vllm_backend.stream(request())
    reader, got = read_in_thread(stream)
    assert fake.completion_asked.wait(WAIT_S)
    stream.close()
    assert fake.completion_left.wait(WAIT_S), "the completion stayed open until vLLM answered"
    reader.join(WAIT_S)
    assert not reader.is_alive() and got == []
    vllm_backend.close()

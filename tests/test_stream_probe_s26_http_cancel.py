"""A caller that stops reading an ``HttpBackend`` stream (closes it, or cancels the task awaiting
it from a worker thread) closes its request at once, not when the server's next event arrives,
and ``chunkcache serve`` then stops generating for it.  The real app runs over uvicorn on a
loopback port with a local backend whose engine makes each token wait for the test."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import httpx
import pytest
from tiny_models import tiny_lm

from chunkcache.core.engine import ChunkEngine, Prefilled
from chunkcache.core.generation import GenerationChunk, GenerationRequest, SamplingParams
from chunkcache.core.http_backend import HttpBackend
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.prompting import arun_stream
from chunkcache.core.segmenter import TextSegment
from chunkcache.core.serve import create_app
from chunkcache.core.serve.launcher import serve_app

PROMPT = " ".join(f"w{(14 + i * 3) % 120}" for i in range(16))  # greedy: no EOS for 400 tokens
MAX_TOKENS = 200
CANCELLED = 'chunkcache_generations_total{outcome="cancelled"}'


class PacedEngine(ChunkEngine):
    """Its prefill waits for ``prefill_gate``; every token after the first for a ``steps``
    permit.  ``decoded`` counts the tokens made."""

    def __init__(self) -> None:
        super().__init__(tiny_lm("llama"))
        self.prefill_gate, self.prefilling = threading.Event(), threading.Event()
        self.steps = threading.Semaphore(0)
        self.decoded = 0

    def prefill(self, *args: Any, **kwargs: Any) -> Prefilled:
        self.prefilling.set()
        assert self.prefill_gate.wait(timeout=30)
        return super().prefill(*args, **kwargs)

    def decode(self, prefilled: Prefilled, params: SamplingParams) -> Iterator[int]:
        for step, token in enumerate(super().decode(prefilled, params)):
            if step and not self.steps.acquire(timeout=30):
                raise TimeoutError("the test never let the next token through")
            self.decoded += 1
            yield token

    def run_free(self) -> None:
        self.prefill_gate.set()
        self.steps.release(MAX_TOKENS)


@pytest.fixture
def server() -> Iterator[tuple[str, PacedEngine]]:
    engine = PacedEngine()
    try:
        with serve_app(create_app(LocalBackend(engine))) as url:
            yield url, engine
    finally:
        engine.run_free()


class WatchedStream(Iterator[GenerationChunk]):
    """A backend's stream that tells when its second piece is asked for: from then on the
    reading thread waits inside the stream, where cancelling the task cannot stop it."""

    def __init__(self, inner: Iterator[GenerationChunk], waiting: threading.Event) -> None:
        self.inner, self.calls, self.waiting = inner, 0, waiting

    def __next__(self) -> GenerationChunk:
        self.calls += 1
        if self.calls == 2:
            self.waiting.set()
        return next(self.inner)

    def __getattr__(self, name: str) -> Any:  # cancel and close, if the stream has them
        return getattr(self.inner, name)


class WatchedBackend:
    """An :class:`HttpBackend` whose streams are watched."""

    def __init__(self, inner: HttpBackend) -> None:
        self.inner, self.waiting = inner, threading.Event()

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        return self.inner.render_chat(messages)

    def stream(self, request: GenerationRequest) -> WatchedStream:
        return WatchedStream(self.inner.stream(request), self.waiting)


def request() -> GenerationRequest:
    sampling = SamplingParams(max_tokens=MAX_TOKENS)
    return GenerationRequest([TextSegment(PROMPT)], policy="full", sampling=sampling)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == name:
            return float(value)
    return 0.0


def server_cancels(url: str, engine: PacedEngine) -> bool:
    """Whether the server cancels the request while its engine still waits (bounded poll)."""
    for _ in range(100):
        if metric(url, CANCELLED) == 1:
            return True
        time.sleep(0.05)
    return False


def assert_generation_stopped(url: str, engine: PacedEngine) -> None:
    assert server_cancels(url, engine), "the request stayed open until the server's next event"
    engine.run_free()
    body = {"model": "chunkcache-local", "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert answer.json()["usage"]["completion_tokens"] == 3
    assert engine.decoded < MAX_TOKENS // 2  # the cancelled request made a few at most


async def test_cancelling_the_task_mid_stream_closes_the_request(
    server: tuple[str, PacedEngine],
) -> None:
    url, engine = server
    engine.prefill_gate.set()
    backend = WatchedBackend(HttpBackend(url))

    async def read() -> None:
        async for _ in arun_stream(backend, request()):
            pass

    task = asyncio.create_task(read())
    assert await asyncio.to_thread(backend.waiting.wait, 30)
    task.cancel()  # the worker thread waits for the second token's event
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(assert_generation_stopped, url, engine)
    backend.inner.close()


async def test_cancelling_the_task_before_the_first_token_closes_the_request(
    server: tuple[str, PacedEngine],
) -> None:
    url, engine = server
    backend = HttpBackend(url)
    backend.model_name  # noqa: B018  asked before, not while, the request waits
    task = asyncio.create_task(anext(arun_stream(backend, request())))
    assert await asyncio.to_thread(engine.prefilling.wait, 30)
    task.cancel()  # no answer yet: the server waits in prefill
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(assert_generation_stopped, url, engine)
    backend.close()


def test_closing_the_stream_from_another_thread_while_it_waits(
    server: tuple[str, PacedEngine],
) -> None:
    url, engine = server
    engine.prefill_gate.set()
    backend = HttpBackend(url)
    stream = backend.stream(request())
    waiting = threading.Event()
    pieces: list[GenerationChunk] = []
    reader = threading.Thread(target=lambda: pieces.extend(WatchedStream(stream, waiting)))
    reader.start()
    assert waiting.wait(30)  # the reader waits for the second token's event
    stream.close()
    assert_generation_stopped(url, engine)
    reader.join(30)
    assert not reader.is_alive()
    assert len(pieces) == 1 and pieces[0].stats is None  # it just ended
    backend.close()


def test_closing_the_generator_between_pieces_closes_the_request(
    server: tuple[str, PacedEngine],
) -> None:
    url, engine = server
    engine.prefill_gate.set()
    backend = HttpBackend(url)
    stream = backend.stream(request())
    next(stream)
    stream.close()
    assert_generation_stopped(url, engine)
    backend.close()

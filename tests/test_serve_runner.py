"""The server's admission bound, 429s under load, and closing a stream when its client leaves."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fake_backend import FakeBackend, GatedBackend

from chunkcache.core.errors import QueueFullError, ShuttingDownError
from chunkcache.core.generation import GenerationRequest
from chunkcache.core.segmenter import TextSegment
from chunkcache.core.serve import ServeSettings, create_app
from chunkcache.core.serve.launcher import serve_app
from chunkcache.core.serve.metrics import ServeMetrics
from chunkcache.core.serve.runner import Runner

REQUEST = GenerationRequest([TextSegment("hello")])
BODY = {"model": FakeBackend.model_name, "prompt": "hello", "stream": True}


def wait_for(condition: object, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_admission_is_bounded_and_released() -> None:
    runner = Runner(FakeBackend(), ServeMetrics(), max_in_flight=2, retry_after_s=1.5)
    tickets = [runner.admit(), runner.admit()]
    with pytest.raises(QueueFullError) as refused:
        runner.admit()
    assert refused.value.retry_after_s >= 1.5
    tickets[0].release()
    tickets[0].release()  # idempotent
    assert runner.in_flight == 1
    del tickets[1]  # a ticket dropped unreleased frees its place too
    assert runner.in_flight == 0
    runner.close()
    with pytest.raises(ShuttingDownError):
        runner.admit()


async def test_runner_streams_every_piece_and_counts() -> None:
    metrics = ServeMetrics()
    runner = Runner(FakeBackend(), metrics, max_in_flight=1)
    pieces = await runner.open(REQUEST)
    assert runner.in_flight == 1
    texts = [piece.text async for piece in pieces]
    assert "".join(texts) == "The answer is in the context above, friend."
    assert runner.in_flight == 0
    assert metrics.value("chunkcache_generations_total", outcome="completed") == 1


async def test_closing_early_closes_the_backend_stream() -> None:
    backend = GatedBackend()
    metrics = ServeMetrics()
    runner = Runner(backend, metrics, max_in_flight=1)
    pieces = await runner.open(REQUEST)  # the first piece is in; the backend waits at its gate
    await pieces.aclose()
    backend.gate.set()
    assert await asyncio.to_thread(backend.closed.wait, 10)
    assert runner.in_flight == 0
    assert metrics.value("chunkcache_generations_total", outcome="cancelled") == 1


def test_client_disconnect_closes_the_generation() -> None:
    backend = GatedBackend()
    app = create_app(backend)
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json=BODY) as response:
            assert next(response.iter_lines()).startswith("data: ")
        # the client has gone; the next piece the server sends finds it gone
        backend.gate.set()
        assert backend.closed.wait(10)
        state = app.state.serve
        assert wait_for(lambda: state.runner.in_flight == 0)
        cancelled = state.metrics.value("chunkcache_generations_total", outcome="cancelled")
        completed = state.metrics.value("chunkcache_generations_total", outcome="completed")
        assert (cancelled, completed) == (1, 0)


def test_a_full_server_answers_429_with_retry_after() -> None:
    backend = GatedBackend()
    app = create_app(backend, ServeSettings(max_queue=1, max_batch=1))
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json=BODY) as first:
            assert first.status_code == 200
            with client.stream("POST", "/v1/completions", json=BODY) as second:
                assert second.status_code == 200  # queued: the bound is max_queue + max_batch
                third = client.post("/v1/completions", json=BODY)
                assert third.status_code == 429
                assert int(third.headers["retry-after"]) >= 1
                backend.gate.set()
                second.read()
            first.read()
        assert client.post("/v1/completions", json=BODY).status_code == 200  # room again

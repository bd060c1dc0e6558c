"""A client that leaves cancels its engine job: the real app over uvicorn on a loopback port,
the batching backend on a tiny random Llama with ONE batch slot, so the next request runs
only if the abandoned one freed it.  (httpx closes a response whose line iterator is dropped
unfinished: that is how these clients leave.)"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from tiny_models import tiny_lm

from chunkcache.core.batching import BatchingBackend
from chunkcache.core.engine import ChunkEngine, Prefilled
from chunkcache.core.models import LoadedModel
from chunkcache.core.serve import create_app
from chunkcache.core.serve.launcher import serve_app

PROMPT = " ".join(f"w{(14 + i * 3) % 120}" for i in range(16))  # greedy: no EOS for 400 tokens


def body(max_tokens: int = 400, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "chunkcache-local",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


class GatedEngine(ChunkEngine):
    """Its prefills wait until ``gate`` opens (once); counts them."""

    def __init__(self, lm: LoadedModel) -> None:
        super().__init__(lm)
        self.entered, self.gate = threading.Event(), threading.Event()
        self.prefills = 0

    def prefill(self, *args: Any, **kwargs: Any) -> Prefilled:
        self.prefills += 1
        self.entered.set()
        assert self.gate.wait(timeout=30)
        return super().prefill(*args, **kwargs)


@pytest.fixture
def gated_server() -> Iterator[tuple[str, GatedEngine]]:
    engine = GatedEngine(tiny_lm("llama"))
    backend = BatchingBackend(engine, max_queue=4, max_batch=1)
    try:
        with serve_app(create_app(backend)) as url:
            yield url, engine
    finally:
        engine.gate.set()


@pytest.fixture
def server() -> Iterator[tuple[str, BatchingBackend]]:
    backend = BatchingBackend(ChunkEngine(tiny_lm("llama")), max_queue=4, max_batch=1)
    with serve_app(create_app(backend)) as url:
        yield url, backend


def metric(client: httpx.Client, name: str) -> float:
    """One sample of /metrics, as Prometheus scrapes it."""
    for line in client.get("/metrics").text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == name:
            return float(value)
    return 0.0


def wait_for(client: httpx.Client, name: str, value: float, tries: int = 200) -> None:
    for _ in range(tries):  # bounded: 200 scrapes
        if metric(client, name) == value:
            return
    raise AssertionError(f"{name} never reached {value} (is {metric(client, name)})")


def test_a_streaming_client_that_leaves_frees_its_slot(
    server: tuple[str, BatchingBackend],
) -> None:
    url, backend = server
    with httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body(stream=True)) as response:
            assert response.status_code == 200
            assert next(response.iter_lines()).startswith("data: ")
        # the connection is closed after one event, the job is cancelled
        wait_for(client, "chunkcache_engine_cancelled_total", 1)
        assert metric(client, "chunkcache_engine_running") == 0
        answer = client.post("/v1/completions", json=body(max_tokens=5))  # the slot is free
        assert answer.status_code == 200
        assert answer.json()["usage"]["completion_tokens"] == 5
        assert metric(client, 'chunkcache_generations_total{outcome="cancelled"}') == 1
        assert metric(client, 'chunkcache_generations_total{outcome="completed"}') == 1
    assert backend.metrics()["tokens_generated_total"] < 400 + 5


def test_a_client_that_leaves_while_queued_is_cancelled_before_it_runs(
    gated_server: tuple[str, GatedEngine],
) -> None:
    url, engine = gated_server
    with httpx.Client(base_url=url, timeout=30) as client, ThreadPoolExecutor(1) as pool:
        blocker = pool.submit(client.post, "/v1/completions", json=body(max_tokens=5))
        assert engine.entered.wait(30)  # the blocker holds the only slot, stuck in prefill
        impatient = httpx.Timeout(30, read=0.5)  # gives up while its request waits
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body(), timeout=impatient)
        wait_for(client, 'chunkcache_generations_total{outcome="cancelled"}', 1)
        engine.gate.set()
        assert blocker.result(timeout=30).status_code == 200
        wait_for(client, "chunkcache_engine_cancelled_total", 1)
        assert client.post("/v1/completions", json=body(max_tokens=5)).status_code == 200
        assert metric(client, "chunkcache_engine_finished_total") == 2
    assert engine.prefills == 2  # the impatient request never ran

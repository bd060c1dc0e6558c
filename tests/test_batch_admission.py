"""Admission reads the waiting requests' cached lengths from the store outside the scheduler's
lock, once per distinct segment, and only when they decide the order (tiny random Llama,
float32; every wait is bounded, so a hang fails instead of blocking)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from engine_support import RecordingEngine, hold_decode_steps
from test_batching import collect, wait_until
from tiny_models import tiny_lm

from chunkcache.core import batch_queue
from chunkcache.core.batching import BatchingBackend
from chunkcache.core.engine import ChunkEngine, TokenSegment
from chunkcache.core.errors import ShuttingDownError
from chunkcache.core.generation import GenerationRequest, SamplingParams
from chunkcache.core.kv_store import KVStore, KVVariant, MemoryKVStore
from chunkcache.core.models import LoadedModel
from chunkcache.core.segmenter import ChunkSegment, Segment, TextSegment

TIMEOUT_S = 30
SCHEDULER = "chunkcache-batching"  # the scheduler thread's name


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


def asking(question: int) -> GenerationRequest:
    """A prompt of three segments: a shared text, a shared chunk, then its own question; it
    generates ``2 + question`` tokens, which tells the engine's records apart."""
    segments: list[Segment] = [
        TextSegment("w1 w2 "),
        ChunkSegment("shared", "w5 w6 w7 w8 w9 w10"),
        TextSegment(f" w{20 + question} w{40 + question}"),
    ]
    return GenerationRequest(segments, sampling=SamplingParams(max_tokens=2 + question))


class HeldStore(MemoryKVStore):
    """Once ``hold`` is set, the scheduler thread's next lookup waits for ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.hold, self.held, self.release = threading.Event(), threading.Event(), threading.Event()

    def contains_segment(self, fingerprint: str, segment_id: str) -> bool:
        if threading.current_thread().name == SCHEDULER and self.hold.is_set():
            self.hold.clear()
            self.held.set()
            assert self.release.wait(timeout=TIMEOUT_S)
        return super().contains_segment(fingerprint, segment_id)


@pytest.fixture
def held_steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    yield from hold_decode_steps(monkeypatch)


def queued_behind_one(backend: BatchingBackend, questions: Sequence[int]) -> list[Any]:
    """Start a request that fills the batch of one and holds it (its decode step waits), then
    queue one request per question behind it; returns the handles, the running one first."""
    running = backend.stream(asking(0))
    assert next(running).text  # from its prefill: it runs, its decode step is held
    return [running, *(backend.submit(asking(q)) for q in questions)]


def finishes(call: Callable[[], object]) -> bool:
    """Whether ``call`` returns within the test's bound (run in a thread of its own)."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=5)
    return not thread.is_alive()


def test_admission_lookups_do_not_hold_the_lock(
    lm: LoadedModel, held_steps: threading.Event
) -> None:
    """While the scheduler reads the store to choose between waiting requests (a Redis round
    trip per segment), new requests are taken and the metrics answer."""
    store = HeldStore()
    backend = BatchingBackend(ChunkEngine(lm, store), max_queue=8, max_batch=1)
    try:
        handles = queued_behind_one(backend, [1, 2])
        store.hold.set()
        held_steps.set()  # the running request ends: the next admission reads the store
        assert store.held.wait(timeout=TIMEOUT_S)
        more: list[Any] = []
        assert finishes(backend.metrics)
        assert finishes(lambda: more.append(backend.submit(asking(3))))
        store.release.set()
        assert all(collect(handle)[1].completion_tokens for handle in [*handles, *more])
    finally:
        store.release.set()
        assert backend.shutdown(timeout_s=TIMEOUT_S)


def test_a_request_cancelled_during_the_lookups_is_not_admitted(
    lm: LoadedModel, held_steps: threading.Event
) -> None:
    store = HeldStore()
    engine = RecordingEngine(lm, store)
    backend = BatchingBackend(engine, max_queue=8, max_batch=1)
    try:
        running, first, second = queued_behind_one(backend, [1, 2])
        store.hold.set()
        held_steps.set()
        assert store.held.wait(timeout=TIMEOUT_S)
        first.close()  # the earlier arrival: the one admitted next, were it still there
        store.release.set()
        for handle in (running, second):
            collect(handle)
    finally:
        store.release.set()
        assert backend.shutdown(timeout_s=TIMEOUT_S)
    assert [call.reserve for call in engine.calls] == [2, 4]  # questions 0 and 2, never 1
    metrics = backend.metrics()
    assert (metrics["finished_total"], metrics["cancelled_total"]) == (2, 1)


def test_a_shutdown_during_the_lookups_sheds_the_queue(
    lm: LoadedModel, held_steps: threading.Event
) -> None:
    store = HeldStore()
    backend = BatchingBackend(ChunkEngine(lm, store), max_queue=8, max_batch=1)
    running, *queued = queued_behind_one(backend, [1, 2])
    store.hold.set()
    held_steps.set()
    assert store.held.wait(timeout=TIMEOUT_S)
    assert not backend.shutdown(timeout_s=0.05, drain=False)
    wait_until(lambda: backend.metrics()["failed_total"] == 2)
    store.release.set()
    assert collect(running)[1].completion_tokens == 2
    for handle in queued:
        with pytest.raises(ShuttingDownError):
            list(handle)
    assert backend.shutdown(timeout_s=TIMEOUT_S)
    assert backend.metrics()["finished_total"] == 1


def test_each_admission_looks_each_distinct_segment_up_once(
    lm: LoadedModel, monkeypatch: pytest.MonkeyPatch, held_steps: threading.Event
) -> None:
    """Three waiting prompts share two segments and have one of their own: choosing the first
    looks up 2 + 3 segments (not 3 x 3), the second 2 + 2, the last none (it is alone)."""
    lookups: list[str] = []
    holds = batch_queue.holds_segment

    def counting(store: KVStore, fingerprint: str, segment_id: str) -> bool:
        if threading.current_thread().name == SCHEDULER:
            lookups.append(segment_id)
        return holds(store, fingerprint, segment_id)

    backend = BatchingBackend(ChunkEngine(lm), max_queue=8, max_batch=1)
    try:
        handles = queued_behind_one(backend, [1, 2, 3])
        monkeypatch.setattr(batch_queue, "holds_segment", counting)
        held_steps.set()
        for handle in handles:
            collect(handle)
    finally:
        assert backend.shutdown(timeout_s=TIMEOUT_S)
    assert len(lookups) == 5 + 4


def test_reading_cached_lengths_leaves_the_memory_stores_eviction_order() -> None:
    """Admission asks which segments are stored for every waiting prompt, often ones that
    never run soon; that must not make their chunks the most recently used and evict the
    chunks running requests just used."""
    store = MemoryKVStore(capacity_bytes=3 * variant("x").num_bytes)
    for name in ("old", "mid", "new"):
        store.put("fp", variant(name))
    segments = [TokenSegment("old", (1, 2), True)]
    assert batch_queue.cached_tokens(store, "fp", segments) == (2, 0)
    store.put("fp", variant("next"))  # evicts the least recently used
    assert store.variants("fp", "old") == []
    assert [len(store.variants("fp", name)) for name in ("mid", "new", "next")] == [1, 1, 1]


def variant(segment_id: str) -> KVVariant:
    """A small stored KV of two tokens."""
    return KVVariant(segment_id, "ctx", 0, True, torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))

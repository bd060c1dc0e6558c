"""Probe of the batching backend (session 25): seeded sampling beside joiners and leavers,
cancellation in prefill, metrics that add up, conversations, slow readers, no state left
after many requests (tiny random Llama, float32; every wait is bounded)."""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import pytest
from engine_support import hold_decode_steps
from test_batch_admission import SCHEDULER, asking, queued_behind_one
from test_batching import collect, request, wait_until
from test_review_batching import TIMEOUT_S, alone, plain
from tiny_models import tiny_lm

from chunkcache.core.batching import BatchingBackend
from chunkcache.core.engine import ChunkEngine, Prefilled, PromptTooLongError, TokenSegment
from chunkcache.core.errors import ShuttingDownError
from chunkcache.core.generation import GenerationRequest
from chunkcache.core.kv_store import MemoryKVStore
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.segmenter import TextSegment


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


class HeldEngine(ChunkEngine):
    """Prefills wait for ``gate`` (after announcing themselves in ``entered``) and keep a
    weak reference to every KV they made."""

    def __init__(self, lm: LoadedModel) -> None:
        super().__init__(lm)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.kvs: list[weakref.ref[Any]] = []

    def prefill(self, segments: Sequence[TokenSegment], *args: Any, **kwargs: Any) -> Prefilled:
        self.entered.set()
        assert self.gate.wait(timeout=TIMEOUT_S)
        prefilled = super().prefill(segments, *args, **kwargs)
        self.kvs.append(weakref.ref(prefilled.kv))
        return prefilled

    def live_kvs(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.kvs)


def in_flight_adds_up(metrics: dict[str, float]) -> bool:
    ended = metrics["finished_total"] + metrics["failed_total"] + metrics["cancelled_total"]
    return metrics["requests_total"] == ended + metrics["waiting"] + metrics["running"]


def test_a_request_in_prefill_counts_as_running(lm: LoadedModel) -> None:
    engine = HeldEngine(lm)
    engine.gate.clear()
    backend = BatchingBackend(engine, max_queue=4, max_batch=2)
    try:
        handle = backend.submit(plain(10, 1, max_tokens=3))
        assert engine.entered.wait(timeout=TIMEOUT_S)  # admitted, in its prefill
        metrics = backend.metrics()
        assert (metrics["requests_total"], metrics["waiting"], metrics["running"]) == (1, 0, 1)
        engine.gate.set()
        assert collect(handle)[1].completion_tokens == 3
    finally:
        engine.gate.set()
        assert backend.shutdown(timeout_s=TIMEOUT_S)
    assert in_flight_adds_up(backend.metrics())


def test_metrics_add_up_at_every_moment_under_load(lm: LoadedModel) -> None:
    """A reader polling the metrics while requests start, finish, fail and are cancelled
    always sees submitted = finished + failed + cancelled + waiting + running."""
    backend = BatchingBackend(ChunkEngine(lm), max_queue=32, max_batch=3)
    broken: list[dict[str, float]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            metrics = backend.metrics()
            if not in_flight_adds_up(metrics):
                broken.append(metrics)
            stop.wait(0.001)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        handles = [backend.submit(plain(5 + i % 7, i, max_tokens=1 + i % 4)) for i in range(24)] + [
            backend.submit(plain(600, 1))
        ]  # fails in its prefill
        for i, handle in enumerate(handles[:24]):
            if i % 5 == 0:
                handle.close()
        for handle in handles[:24]:
            list(handle)
        with pytest.raises(PromptTooLongError):
            list(handles[24])
        wait_until(lambda: backend.metrics()["running"] == backend.metrics()["waiting"] == 0)
    finally:
        stop.set()
        poller.join(timeout=TIMEOUT_S)
        assert backend.shutdown(timeout_s=TIMEOUT_S)
    assert broken == []


def test_cancelled_in_prefill_leaves_and_counts_once(lm: LoadedModel) -> None:
    engine = HeldEngine(lm)
    engine.gate.clear()
    backend = BatchingBackend(engine, max_queue=4, max_batch=2)
    try:
        handle = backend.submit(request("long", variant=2, max_tokens=300))
        assert engine.entered.wait(timeout=TIMEOUT_S)
        handle.close()
        engine.gate.set()
        wait_until(lambda: backend.metrics()["cancelled_total"] == 1)
        metrics = backend.metrics()
        assert metrics["running"] == metrics["finished_total"] == 0
        assert metrics["tokens_generated_total"] < 300
        assert collect(backend.stream(plain(10, 1, max_tokens=4)))[1].completion_tokens == 4
        assert engine.live_kvs() == 0
    finally:
        engine.gate.set()
        assert backend.shutdown(timeout_s=TIMEOUT_S)


def test_seeded_samples_match_alone_while_others_join_and_leave(lm: LoadedModel) -> None:
    seeded = [
        plain(8 + 9 * i, i, max_tokens=12 + 5 * i, temperature=1.0, seed=100 + i) for i in range(4)
    ]
    expected = alone(lm, seeded)
    backend = BatchingBackend(ChunkEngine(lm), max_queue=16, max_batch=4)
    try:
        first = backend.submit(seeded[0])
        pieces = [next(first).text]
        leaver = backend.submit(request("x", variant=2, max_tokens=300, temperature=0.7, seed=3))
        assert next(leaver).text
        second = backend.submit(seeded[1])
        pieces.append(next(first).text)
        leaver.close()  # leaves mid-way
        rest = [backend.submit(r) for r in seeded[2:]]
        joiner = backend.submit(plain(40, 9, max_tokens=5))  # joins later, greedy
        texts = ["".join(pieces) + collect(first)[0]]
        texts += [collect(handle)[0] for handle in [second, *rest]]
        collect(joiner)
    finally:
        assert backend.shutdown(timeout_s=TIMEOUT_S)
    assert texts == [text for text, _ in expected]


def test_a_reader_that_stops_reading_holds_no_one_up(lm: LoadedModel) -> None:
    requests = [plain(20, 1, max_tokens=40), plain(7, 2, max_tokens=6), plain(30, 3, max_tokens=9)]
    expected = alone(lm, requests)
    backend = BatchingBackend(ChunkEngine(lm), max_queue=8, max_batch=2)
    try:
        slow = backend.submit(requests[0])
        fast = [backend.submit(r) for r in requests[1:]]
        assert [collect(handle)[0] for handle in fast] == [t for t, _ in expected[1:]]
        wait_until(lambda: backend.metrics()["finished_total"] == 3)  # unread, it ended
        assert collect(slow)[0] == expected[0][0]
    finally:
        assert backend.shutdown(timeout_s=TIMEOUT_S)


def test_conversation_turns_match_the_local_backend(lm: LoadedModel) -> None:
    def turns(backend: Any, conversation: str, base: int) -> list[tuple[str, int]]:
        segments: list[Any] = [TextSegment(" ".join(f"w{base + i}" for i in range(12)))]
        out = []
        for turn in range(3):
            req = GenerationRequest(list(segments), conversation, sampling=plain(1, 0).sampling)
            text, stats = collect(backend.stream(req))
            out.append((text, stats.extra["prefix_tokens"]))
            segments += [TextSegment(text), TextSegment(f" w{turn + 3} w{turn + 40}")]
        return out

    local = LocalBackend(ChunkEngine(lm))
    expected = [turns(local, f"c{n}", 10 * n) for n in range(3)]
    backend = BatchingBackend(ChunkEngine(lm), max_queue=8, max_batch=3)
    results: list[Any] = [None] * 3
    try:
        threads = [
            threading.Thread(
                target=lambda n=n: results.__setitem__(n, turns(backend, f"c{n}", 10 * n)),
                daemon=True,
            )
            for n in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=TIMEOUT_S)
        assert not any(thread.is_alive() for thread in threads)
    finally:
        assert backend.shutdown(timeout_s=TIMEOUT_S)
    assert results == expected
    assert all(prefix > 0 for conv in expected for _, prefix in conv[1:])


def test_shutdown_under_load_ends_everyone_and_refuses_later(lm: LoadedModel) -> None:
    for drain in (True, False):
        backend = BatchingBackend(ChunkEngine(lm), max_queue=16, max_batch=2)
        handles = [backend.submit(plain(6 + i, i, max_tokens=3 + i)) for i in range(10)]
        assert backend.shutdown(timeout_s=TIMEOUT_S, drain=drain)
        with pytest.raises(ShuttingDownError):
            backend.submit(plain(5, 1))
        outcomes = []
        for handle in handles:
            try:
                outcomes.append(collect(handle)[1].finish_reason)
            except ShuttingDownError:
                outcomes.append("shed")
        metrics = backend.metrics()
        assert in_flight_adds_up(metrics)
        assert metrics["finished_total"] == outcomes.count("length") + outcomes.count("stop")
        assert metrics["failed_total"] == outcomes.count("shed")
        assert ("shed" in outcomes) is not drain


def test_two_hundred_requests_leave_no_state(lm: LoadedModel) -> None:
    engine = HeldEngine(lm)
    engine.conversations.max_conversations = 4
    backend = BatchingBackend(engine, max_queue=64, max_batch=4)
    handles_alive: list[weakref.ref[Any]] = []
    try:
        for wave in range(10):
            handles = []
            for i in range(20):
                n = wave * 20 + i
                if n % 7 == 3:
                    req = plain(600, n)  # fails in prefill
                elif n % 5 == 1:
                    req = GenerationRequest(
                        [TextSegment(f"w{n % 100} w5 w6")],
                        f"conv{n}",
                        sampling=plain(1, 0).sampling,
                    )
                else:
                    req = plain(3 + n % 11, n, max_tokens=1 + n % 5)
                handles.append(backend.submit(req))
            for i, handle in enumerate(handles):
                if i % 6 == 0:
                    handle.close()
                with contextlib.suppress(PromptTooLongError):  # the n % 7 == 3 ones
                    list(handle)
                handles_alive.append(weakref.ref(handle))
            del handles, handle
        wait_until(lambda: backend.metrics()["running"] == backend.metrics()["waiting"] == 0)
        scheduler = backend._scheduler
        assert not scheduler._running and not len(scheduler._waiting)
        assert scheduler._starting == 0
        gc.collect()
        assert not [ref for ref in handles_alive if ref() is not None]
        assert engine.live_kvs() <= len(engine.remembered()) <= 4
        assert in_flight_adds_up(backend.metrics())
        assert backend.metrics()["requests_total"] == 200
    finally:
        assert backend.shutdown(timeout_s=TIMEOUT_S)


class FailingOnceStore(MemoryKVStore):
    """Once ``armed``, the scheduler thread's next lookup raises (a user's store failing)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = threading.Event()

    def contains_segment(self, fingerprint: str, segment_id: str) -> bool:
        if threading.current_thread().name == SCHEDULER and self.armed.is_set():
            self.armed.clear()
            raise ConnectionError("the store went away for a moment")
        return super().contains_segment(fingerprint, segment_id)


def test_a_store_that_fails_during_admission_does_not_stop_the_scheduler(
    lm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admission reads the waiting prompts' cached lengths from the store; a failure there
    killed the scheduler thread, and with it every request then and after."""
    store = FailingOnceStore()
    backend = BatchingBackend(ChunkEngine(lm, store), max_queue=8, max_batch=1)
    try:
        steps = hold_decode_steps(monkeypatch)
        go = next(steps)
        handles = queued_behind_one(backend, [1, 2])
        store.armed.set()
        go.set()  # the running request ends: the next admission reads the store
        assert all(collect(handle)[1].completion_tokens for handle in handles)
        assert not store.armed.is_set()  # it did fail once
        assert collect(backend.stream(asking(3)))[1].completion_tokens
    finally:
        assert backend.shutdown(timeout_s=TIMEOUT_S)

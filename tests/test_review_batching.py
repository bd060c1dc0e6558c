"""Adversarial review of the batching backend: many threads at once, failures and
cancellations mid-batch, shutdown and a dead scheduler, window edges, fairness (tiny random
Llama, float32; every wait is bounded, so a hang fails instead of blocking)."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_support import assert_read_on_as_alone, hold_decode_steps, joined, start_readers
from test_batching import collect, request, wait_until
from tiny_models import tiny_lm

from chunkcache.core import batch_scheduler
from chunkcache.core.batch_queue import Job, RequestHandle
from chunkcache.core.batching import BatchingBackend
from chunkcache.core.engine import ChunkEngine, Prefilled, TokenSegment
from chunkcache.core.errors import (
    BackendUnavailableError,
    PromptTooLongError,
    ShuttingDownError,
)
from chunkcache.core.generation import (
    GenerationChunk,
    GenerationRequest,
    GenerationStats,
    SamplingParams,
)
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.prompting import run_stream
from chunkcache.core.segmenter import TextSegment
from chunkcache.core.text_stream import TextStream

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


def words(n: int, seed: int) -> str:
    """A prompt of exactly ``n`` tokens of the tiny vocabulary."""
    return " ".join(f"w{(seed * 11 + i * 7) % 120}" for i in range(n))


def plain(n: int, variant: int, **sampling: Any) -> GenerationRequest:
    """An ``n``-token prompt, no KV reuse (policy full): its answer depends on it alone."""
    params = SamplingParams(**{"max_tokens": 8, **sampling})
    return GenerationRequest([TextSegment(words(n, variant))], policy="full", sampling=params)


def alone(lm: LoadedModel, requests: list[GenerationRequest]) -> list[tuple[str, Any]]:
    """Each request run by itself on the one-at-a-time backend."""
    local = LocalBackend(ChunkEngine(lm))
    return [collect(local.stream(r)) for r in requests]


def in_threads(backend: BatchingBackend, requests: list[GenerationRequest]) -> list[Any]:
    """Every request submitted from its own thread, all at once; each one's result or error."""
    results: list[Any] = [None] * len(requests)
    start = threading.Barrier(len(requests))

    def run(i: int) -> None:
        start.wait(timeout=TIMEOUT_S)
        try:
            results[i] = collect(backend.stream(requests[i]))
        except Exception as error:
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a request hung"
    return results


def drained(backend: BatchingBackend) -> dict[str, float]:
    """The metrics once nothing waits or runs."""
    wait_until(lambda: backend.metrics()["running"] == backend.metrics()["waiting"] == 0)
    return backend.metrics()


class KVWatch(ChunkEngine):
    """Keeps a weak reference to every prefilled request's KV."""

    def __init__(self, lm: LoadedModel) -> None:
        super().__init__(lm)
        self.kvs: list[weakref.ref[Any]] = []

    def prefill(self, *args: Any, **kwargs: Any) -> Prefilled:
        prefilled = super().prefill(*args, **kwargs)
        self.kvs.append(weakref.ref(prefilled.kv))
        return prefilled

    def live_kvs(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.kvs)


@pytest.fixture
def held_steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    yield from hold_decode_steps(monkeypatch)


def test_many_threads_at_once_each_get_exactly_their_own_answer(lm: LoadedModel) -> None:
    # prompts of 1..450 tokens, max_tokens 1..40, greedy and seeded sampling
    requests = [
        plain(1 + (i * 97) % 450, i, max_tokens=1 + (i * 13) % 40)
        if i % 3
        else plain(5 + i, i, max_tokens=20, temperature=0.9, top_p=0.8, seed=i)
        for i in range(16)
    ]
    expected = alone(lm, requests)
    backend = BatchingBackend(ChunkEngine(lm), max_queue=16, max_batch=4)
    try:
        results = in_threads(backend, requests)
    finally:
        assert backend.shutdown(timeout_s=TIMEOUT_S)
    assert not [r for r in results if isinstance(r, Exception)]
    for (text, stats), (want_text, want) in zip(results, expected, strict=True):
        assert text == want_text
        assert (stats.finish_reason, stats.completion_tokens) == (
            want.finish_reason,
            want.completion_tokens,
        )
        assert stats.prompt_tokens == want.prompt_tokens
    metrics = backend.metrics()
    assert metrics["requests_total"] == metrics["finished_total"] == len(requests)
    assert metrics["failed_total"] == metrics["cancelled_total"] == 0
    assert metrics["batch_size_mean"] > 1


def test_failures_mid_batch_stay_with_their_request(
    lm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt over the window, an empty one, a sampler failing at its third token and a
    stop string, all in one batch with good requests: each ends its own way, alone."""
    calls: dict[int, int] = {}
    sample = batch_scheduler.sample_token

    def flaky(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
        if params.seed == 666:
            calls[id(gen)] = calls.get(id(gen), 0) + 1
            if calls[id(gen)] == 3:
                raise RuntimeError("the sampler broke on request 666")
        return sample(logits, params, gen)

    monkeypatch.setattr(batch_scheduler, "sample_token", flaky)
    good = [plain(30, 1, max_tokens=40), plain(200, 2, max_tokens=30)]
    stopping = request("s", variant=4, max_tokens=16, stop=("w17 w77",))
    expected = alone(lm, [*good, stopping])
    assert expected[2][1].finish_reason == "stop"
    backend = BatchingBackend(ChunkEngine(lm), max_queue=8, max_batch=4)
    try:
        handles = [backend.submit(r) for r in good]
        firsts = [next(handle) for handle in handles]  # both run now
        too_long = backend.submit(plain(600, 3))
        with pytest.raises(PromptTooLongError):  # fit_window: refused before queueing
            backend.submit(plain(600, 3, fit_window=True))
        empty = backend.submit(GenerationRequest([TextSegment("   ")]))
        broken = backend.submit(plain(20, 4, max_tokens=30, temperature=1.0, seed=666))
        stop = backend.submit(stopping)
        with pytest.raises(PromptTooLongError, match="exceed the model's context window"):
            list(too_long)
        with pytest.raises(ValueError, match="no tokens"):
            list(empty)
        with pytest.raises(RuntimeError, match="request 666"):
            list(broken)
        text, stats = collect(stop)
        assert (text, stats.finish_reason) == (expected[2][0], "stop")
        assert_read_on_as_alone(handles, firsts, expected)
    finally:
        assert backend.shutdown(timeout_s=TIMEOUT_S)
    metrics = backend.metrics()
    assert (metrics["finished_total"], metrics["failed_total"]) == (3, 3)


def test_abandoned_streams_free_their_slot_and_their_kv(lm: LoadedModel) -> None:
    """Closed after a piece (the handle still held), a consumer raising inside its loop, a
    checked stream closed early: none runs on, and no request's KV outlives its end."""
    engine = KVWatch(lm)
    backend = BatchingBackend(engine, max_queue=8, max_batch=2)
    long = request("long", variant=2, max_tokens=400)
    try:
        closed = backend.stream(long)
        assert next(closed).text
        closed.close()  # the consumer keeps the handle
        with pytest.raises(KeyError):
            for _ in backend.stream(request("long2", variant=4, max_tokens=400)):
                raise KeyError("the consumer broke")
        checked = run_stream(backend, request("long3", variant=5, max_tokens=400))
        assert next(checked).text
        checked.close()  # type: ignore[attr-defined]
        finished = backend.submit(plain(10, 1, max_tokens=5))
        assert collect(finished)[1].completion_tokens == 5
        metrics = drained(backend)
        assert metrics["cancelled_total"] == 3 and metrics["finished_total"] == 1
        assert metrics["tokens_generated_total"] < 3 * 400
        assert engine.live_kvs() == 0  # `closed` and `finished` are still referenced here
        del closed, finished
    finally:
        assert backend.shutdown(timeout_s=TIMEOUT_S)


def test_a_stream_closed_from_another_thread_ends_its_blocked_reader(
    lm: LoadedModel, held_steps: threading.Event
) -> None:
    backend = BatchingBackend(ChunkEngine(lm), max_queue=4, max_batch=1)
    try:
        running = backend.stream(request("long", variant=2, max_tokens=400))
        assert next(running).text  # from its prefill; its decoding is held
        queued = backend.stream(plain(10, 1))  # waits: the batch (of 1) is full
        pieces: list[Any] = []
        reader = threading.Thread(target=lambda: pieces.extend(queued), daemon=True)
        reader.start()
        queued.close()
        reader.join(timeout=TIMEOUT_S)
        assert not reader.is_alive() and pieces == []
        running.close()
        held_steps.set()
        metrics = drained(backend)
        assert metrics["cancelled_total"] == 2 and metrics["finished_total"] == 0
    finally:
        held_steps.set()
        assert backend.shutdown(timeout_s=TIMEOUT_S)


def test_shutdown_with_readers_blocked_ends_every_one(
    lm: LoadedModel, held_steps: threading.Event
) -> None:
    backend = BatchingBackend(ChunkEngine(lm), max_queue=8, max_batch=1)
    running = backend.stream(request("long", variant=2, max_tokens=60))
    assert next(running).text  # from its prefill; its decoding is held
    handles = [backend.submit(plain(10, i)) for i in range(4)]
    readers, outcomes = start_readers(handles)
    assert not backend.shutdown(timeout_s=0.05, drain=False)  # "long" is still running
    joined(readers)
    assert all(isinstance(outcome, ShuttingDownError) for outcome in outcomes)
    with pytest.raises(ShuttingDownError):
        backend.submit(plain(10, 9))
    held_steps.set()
    assert collect(running)[1].finish_reason in ("stop", "length")  # the running one ends
    assert backend.shutdown(timeout_s=TIMEOUT_S)
    assert backend.shutdown(timeout_s=1)  # again: nothing left, no hang
    metrics = backend.metrics()
    assert (metrics["finished_total"], metrics["failed_total"]) == (1, 4)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_scheduler_fails_its_readers_and_refuses_new_requests(
    lm: LoadedModel, monkeypatch: pytest.MonkeyPatch, held_steps: threading.Event
) -> None:
    """Should the scheduler thread itself die, its readers get an error and new requests
    are refused at once, instead of being queued for nobody."""
    backend = BatchingBackend(ChunkEngine(lm), max_queue=8, max_batch=1)
    running = backend.stream(request("long", variant=2, max_tokens=400))
    assert next(running).text
    queued = backend.submit(plain(10, 1))

    def broken() -> None:
        raise MemoryError("out of memory in the scheduler")

    monkeypatch.setattr(backend._scheduler, "_drop_cancelled", broken)
    held_steps.set()
    for handle in (running, queued):
        with pytest.raises(BackendUnavailableError):
            list(handle)
    with pytest.raises(BackendUnavailableError, match="scheduler stopped"):
        backend.submit(plain(10, 2))
    assert backend.shutdown(timeout_s=1)


def test_a_last_piece_queued_as_the_scheduler_exits_is_still_read(lm: LoadedModel) -> None:
    """The reader's wait timed out, then the scheduler put the last piece and stopped before
    the reader looked whether it still runs: the piece is read, not lost to an error."""
    segments = [TokenSegment("t", (5, 6), is_chunk=False)]
    job = Job(plain(2, 1), segments, TextStream(lm.tokenizer, lm.eos_ids, ()))
    last = GenerationChunk("the end", GenerationStats(policy="full"))

    def alive() -> bool:
        job.events.put(last)  # the scheduler's last act
        return False

    assert list(RequestHandle(job, alive)) == [last]


def test_window_edges_and_tiny_budgets_in_one_batch(lm: LoadedModel) -> None:
    window = lm.spec.context_window
    requests = [
        plain(window - 1, 1, max_tokens=1),  # fills the window exactly
        plain(window - 3, 2, max_tokens=3),  # so does this one, after two decode steps
        plain(window - 5, 3, max_tokens=100, fit_window=True),  # cut to 5
        plain(1, 4, max_tokens=1),
        plain(3, 5, max_tokens=60),
    ]
    expected = alone(lm, requests)
    assert expected[2][1].completion_tokens <= 5
    backend = BatchingBackend(ChunkEngine(lm), max_queue=8, max_batch=5)
    try:
        results = in_threads(backend, requests)
        for fit_window in (False, True):  # a prompt that fills the window has no room left
            with pytest.raises(PromptTooLongError):
                collect(backend.stream(plain(window, 6, max_tokens=1, fit_window=fit_window)))
    finally:
        assert backend.shutdown(timeout_s=TIMEOUT_S)
    assert [(t, s.completion_tokens) for t, s in results] == [
        (t, s.completion_tokens) for t, s in expected
    ]
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_a_long_request_does_not_hold_up_short_ones(
    lm: LoadedModel, monkeypatch: pytest.MonkeyPatch, held_steps: threading.Event
) -> None:
    """Short requests sent while a long one decodes finish before it: they share the batch."""
    ended: list[int] = []
    finish = batch_scheduler.Scheduler._finish

    def record(self: batch_scheduler.Scheduler, job: Job) -> None:
        ended.append(job.request.sampling.max_tokens)
        finish(self, job)

    monkeypatch.setattr(batch_scheduler.Scheduler, "_finish", record)
    backend = BatchingBackend(ChunkEngine(lm), max_queue=8, max_batch=2)
    try:
        long = backend.stream(request("long", variant=2, max_tokens=300))
        assert next(long).text  # from its prefill; its decoding is held
        shorts = [backend.submit(plain(10 + i, i, max_tokens=4)) for i in range(5)]
        held_steps.set()
        for handle in shorts:
            collect(handle)
        collect(long)
    finally:
        held_steps.set()
        assert backend.shutdown(timeout_s=TIMEOUT_S)
    assert ended == [4] * 5 + [300]


def test_local_backend_lends_the_engine_in_turns(lm: LoadedModel) -> None:
    """One-at-a-time backend, two threads: a stream decoding in a tight loop does not keep
    the engine from a short request sent meanwhile (it is held per step, never per stream)."""
    backend = LocalBackend(ChunkEngine(lm))
    ended: list[str] = []
    tokens: dict[str, int] = {}
    long = backend.stream(plain(16, 1, max_tokens=480))
    assert next(long).text

    def run(name: str, stream: Iterator[GenerationChunk]) -> None:
        tokens[name] = collect(stream)[1].completion_tokens
        ended.append(name)

    threads = [
        threading.Thread(target=run, args=("long", long), daemon=True),
        threading.Thread(target=run, args=("short", backend.stream(plain(10, 2))), daemon=True),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads)
    assert ended == ["short", "long"]
    assert tokens["long"] > 10 * tokens["short"]

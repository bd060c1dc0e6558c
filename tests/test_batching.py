"""The batching backend: same text as the local backend, queue limits, cache-aware order,
cancellation, shutdown, failures kept to their request (tiny random Llama, float32)."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from tiny_models import tiny_lm

from chunkcache.core.batching import BatchingBackend
from chunkcache.core.chunk_ids import chunk_id_of
from chunkcache.core.engine import ChunkEngine, Prefilled, PromptTooLongError, TokenSegment
from chunkcache.core.errors import EmptyPromptError, QueueFullError, ShuttingDownError
from chunkcache.core.generation import GenerationChunk, GenerationRequest, SamplingParams
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.segmenter import ChunkSegment, Segment, TextSegment


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


class GatedEngine(ChunkEngine):
    """Each prefill records its prompt's first chunk id, then waits until ``gate`` is set."""

    def __init__(self, lm: LoadedModel) -> None:
        super().__init__(lm)
        self.gate = threading.Event()
        self.order: list[str] = []

    def prefill(self, segments: Sequence[TokenSegment], *args: Any, **kwargs: Any) -> Prefilled:
        self.order.append(chunk_id_of(next(s.segment_id for s in segments if s.is_chunk)))
        assert self.gate.wait(timeout=30)
        return super().prefill(segments, *args, **kwargs)


@pytest.fixture
def gated(lm: LoadedModel) -> Iterator[tuple[BatchingBackend, GatedEngine]]:
    engine = GatedEngine(lm)
    backend = BatchingBackend(engine, max_queue=4, max_batch=2, starvation_window=2)
    yield backend, engine
    engine.gate.set()
    assert backend.shutdown(timeout_s=10, drain=False)


def request(chunk: str, variant: int = 0, words: int = 10, **sampling: Any) -> GenerationRequest:
    """A prompt around chunk ``chunk``; variants 2, 4, 5 run 300 greedy tokens without EOS."""
    text = " ".join(f"w{(variant * 7 + i * 3) % 120}" for i in range(words + variant * 3))
    segments: list[Segment] = [TextSegment("w1 w2 "), ChunkSegment(chunk, text), TextSegment(" w9")]
    return GenerationRequest(segments, sampling=SamplingParams(**{"max_tokens": 6, **sampling}))


def collect(chunks: Iterator[GenerationChunk]) -> tuple[str, Any]:
    pieces = list(chunks)
    assert [piece.stats is not None for piece in pieces].count(True) == 1
    assert pieces[-1].stats is not None
    return "".join(piece.text for piece in pieces), pieces[-1].stats


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_batched_text_equals_each_request_alone(lm: LoadedModel) -> None:
    requests = [
        request("a", variant=2, max_tokens=24),
        request("b", variant=4, max_tokens=16, stop=("w17 w77",)),
        request("c", variant=5, max_tokens=20, temperature=0.8, top_p=0.9, seed=7),
        request("d", variant=1, words=30, max_tokens=12),
    ]
    local = LocalBackend(ChunkEngine(lm))
    expected = [collect(local.stream(r)) for r in requests]
    backend = BatchingBackend(ChunkEngine(lm), max_batch=4)
    try:
        handles = [backend.submit(r) for r in requests]
        results = [collect(iter(handle)) for handle in handles]
    finally:
        assert backend.shutdown()
    for (text, stats), (want_text, want) in zip(results, expected, strict=True):
        assert text == want_text
        assert stats.finish_reason == want.finish_reason
        assert stats.completion_tokens == want.completion_tokens
        assert stats.prompt_tokens == want.prompt_tokens
        assert 0 < stats.ttft_s <= stats.total_s
        assert stats.extra["queue_s"] >= 0
    assert expected[1][1].finish_reason == "stop"  # the stop string was hit
    assert max(stats.extra["batch_size"] for _, stats in results) > 1
    metrics = backend.metrics()
    assert metrics["finished_total"] == 4 and metrics["batch_size_mean"] > 1
    assert metrics["tokens_generated_total"] >= sum(s.completion_tokens for _, s in results)


def test_a_full_queue_refuses_at_once_and_loses_nothing(
    gated: tuple[BatchingBackend, GatedEngine],
) -> None:
    backend, engine = gated
    first = backend.submit(request("a"))
    wait_until(lambda: engine.order == ["a"])  # admitted, stuck in prefill
    # max_batch + max_queue = 6 in flight: the batch's free slot holds one more waiting job
    queued = [backend.submit(request(name)) for name in ("b", "c", "d", "e", "f")]
    with pytest.raises(QueueFullError) as refused:
        backend.stream(request("g"))
    assert refused.value.retry_after_s > 0
    queued.pop().close()  # a client left while waiting: its place is free at once
    queued.append(backend.submit(request("h")))
    engine.gate.set()
    texts = [collect(iter(handle))[0] for handle in [first, *queued]]
    assert all(texts)
    metrics = backend.metrics()
    assert (metrics["requests_total"], metrics["rejected_total"]) == (7, 1)
    assert (metrics["finished_total"], metrics["cancelled_total"]) == (6, 1)


def test_cached_requests_go_first_within_the_starvation_window(
    gated: tuple[BatchingBackend, GatedEngine],
) -> None:
    backend, engine = gated
    engine.gate.set()
    collect(backend.stream(request("hot")))  # the store now holds chunk "hot"
    engine.gate.clear()
    blocker = backend.submit(request("blocker"))
    wait_until(lambda: engine.order[-1] == "blocker")
    late = [backend.submit(request(name)) for name in ("cold", "hot", "hot", "hot")]
    engine.gate.set()
    for handle in [blocker, *late]:
        collect(iter(handle))
    # The cached "hot" requests arrived after "cold" but go first, until two of them have
    # passed it (the starvation window): then "cold" runs before the third.
    assert engine.order == ["hot", "blocker", "hot", "hot", "cold", "hot"]


def test_cancelled_requests_leave_the_queue_and_the_batch(
    gated: tuple[BatchingBackend, GatedEngine],
) -> None:
    backend, engine = gated
    long_running = backend.stream(request("long", variant=2, max_tokens=300))
    waiting = backend.submit(request("never"))
    waiting.cancel()
    engine.gate.set()
    assert next(long_running).text  # it runs; now its consumer goes away
    long_running.close()
    wait_until(lambda: backend.metrics()["cancelled_total"] == 2)
    metrics = backend.metrics()
    assert metrics["running"] == metrics["waiting"] == 0
    assert metrics["tokens_generated_total"] < 300
    assert "never" not in engine.order
    _, stats = collect(backend.stream(request("after")))  # the scheduler goes on
    assert stats.completion_tokens > 0


def test_closing_a_stream_after_one_piece_frees_its_slot(
    gated: tuple[BatchingBackend, GatedEngine],
) -> None:
    backend, engine = gated
    engine.gate.set()
    first = backend.stream(request("long", variant=2, max_tokens=400))
    assert next(first).text  # running: the batch (max_batch=2) has one slot left
    second = backend.stream(request("long2", variant=4, max_tokens=400))
    assert next(second).text
    queued = backend.submit(request("next"))
    assert backend.metrics()["waiting"] == 1  # the batch is full
    first.close()
    wait_until(lambda: "next" in engine.order)  # the freed slot went to the queued request
    second.close()
    _, stats = collect(queued)
    assert stats.completion_tokens > 0
    wait_until(lambda: backend.metrics()["running"] == 0)
    metrics = backend.metrics()
    assert (metrics["cancelled_total"], metrics["finished_total"]) == (2, 1)
    assert metrics["tokens_generated_total"] < 400


@pytest.mark.parametrize("abandon", ["close unread", "drop unread", "drop half read"])
def test_an_abandoned_stream_is_cancelled(
    gated: tuple[BatchingBackend, GatedEngine], abandon: str
) -> None:
    backend, engine = gated
    engine.gate.set()
    handle = backend.stream(request("long", variant=2, max_tokens=400))
    if abandon == "close unread":
        handle.close()
    elif abandon == "drop half read":
        assert next(handle).text
    del handle  # the scheduler holds the job, not the handle: its finalizer cancels the job
    gc.collect()
    wait_until(lambda: backend.metrics()["cancelled_total"] == 1)
    metrics = backend.metrics()
    assert metrics["running"] == metrics["waiting"] == metrics["finished_total"] == 0
    assert metrics["tokens_generated_total"] < 400
    _, stats = collect(backend.stream(request("after")))  # the scheduler goes on
    assert stats.completion_tokens > 0


@pytest.mark.parametrize("drain", [True, False])
def test_shutdown_drains_or_rejects_the_queue(
    gated: tuple[BatchingBackend, GatedEngine], drain: bool
) -> None:
    backend, engine = gated
    running = backend.submit(request("a"))
    wait_until(lambda: engine.order == ["a"])
    queued = [backend.submit(request(name)) for name in ("b", "c")]
    assert not backend.shutdown(timeout_s=0.05, drain=drain)  # "a" is still in prefill
    with pytest.raises(ShuttingDownError):
        backend.submit(request("late"))
    engine.gate.set()
    assert collect(iter(running))[1].finish_reason in ("stop", "length")
    for handle in queued:
        if drain:
            collect(iter(handle))
        else:
            with pytest.raises(ShuttingDownError):
                list(handle)
    assert backend.shutdown(timeout_s=10)
    metrics = backend.metrics()
    assert metrics["finished_total"] == (3 if drain else 1)
    assert metrics["failed_total"] == (0 if drain else 2)


def test_a_failing_request_fails_alone(lm: LoadedModel) -> None:
    backend = BatchingBackend(ChunkEngine(lm), max_batch=3)
    try:
        good = [backend.submit(request(name, variant=2, max_tokens=10)) for name in ("a", "b")]
        too_long = backend.submit(request("huge", words=600))
        empty = backend.submit(GenerationRequest([TextSegment("")]))
        with pytest.raises(PromptTooLongError):
            list(too_long)
        with pytest.raises(EmptyPromptError, match="no tokens"):  # a refusal, not a bug
            list(empty)
        assert [collect(iter(handle))[1].completion_tokens for handle in good] == [10, 10]
    finally:
        assert backend.shutdown()
    metrics = backend.metrics()
    assert (metrics["finished_total"], metrics["failed_total"]) == (2, 2)


def test_every_request_ends_exactly_once(lm: LoadedModel) -> None:
    backend = BatchingBackend(ChunkEngine(lm), max_queue=16, max_batch=3)
    try:
        handles = [
            backend.submit(
                request(f"c{i % 4}", variant=i % 6, max_tokens=1 + 3 * i, temperature=0.5)
            )
            for i in range(12)
        ]
        stats = [collect(iter(handle))[1] for handle in handles]  # exactly one final chunk each
    finally:
        assert backend.shutdown()
    assert all(s.completion_tokens <= 1 + 3 * i for i, s in enumerate(stats))
    metrics = backend.metrics()
    assert metrics["requests_total"] == metrics["finished_total"] == 12
    assert metrics["failed_total"] == metrics["cancelled_total"] == 0
    assert metrics["waiting"] == metrics["running"] == 0


def test_a_conversation_reuses_its_last_turn(lm: LoadedModel) -> None:
    backend = BatchingBackend(ChunkEngine(lm))
    first = request("a", variant=2)
    try:
        turn = GenerationRequest(first.segments, "conv", sampling=first.sampling)
        text, _ = collect(backend.stream(turn))
        follow = [*first.segments, TextSegment(text), TextSegment(" w3 w4")]
        turn = GenerationRequest(follow, "conv", sampling=first.sampling)
        _, stats = collect(backend.stream(turn))
    finally:
        assert backend.shutdown()
    assert stats.extra["prefix_tokens"] > 0


@pytest.mark.slow
def test_concurrent_requests_on_the_default_model_batch() -> None:
    backend = BatchingBackend.default(max_batch=8)
    questions = ["What is RAG?", "Name a colour.", "Count to five.", "Say hi.", "Why?", "2+2?"]
    try:
        handles = [
            backend.submit(
                GenerationRequest(
                    [TextSegment(backend.render_chat([{"role": "user", "content": q}]))],
                    sampling=SamplingParams(max_tokens=16),
                )
            )
            for q in questions
        ]
        results = [collect(iter(handle)) for handle in handles]
    finally:
        assert backend.shutdown()
    assert all(text.strip() for text, _ in results)
    assert backend.metrics()["finished_total"] == len(questions)
    assert backend.metrics()["batch_size_mean"] > 1

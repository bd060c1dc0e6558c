"""A failed batched decode step: only the requests whose own step fails end, each with its own
error object (tiny random Llama, float32; every wait is bounded)."""

from __future__ import annotations

import gc
import threading
import traceback
import weakref
from collections.abc import Sequence

import pytest
import torch
from engine_support import TIMEOUT_S, RecordingEngine, assert_read_on_as_alone, read_in_threads
from test_batching import collect
from tiny_models import tiny_lm

from chunkcache.core import batch_scheduler
from chunkcache.core.batching import BatchingBackend
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.generation import GenerationRequest, SamplingParams
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.segmenter import TextSegment
from chunkcache.kernels.kv import SeqKV

BAD = 13  # max_tokens of the request whose decode steps fail


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


def plain(n: int, variant: int, max_tokens: int) -> GenerationRequest:
    """An ``n``-token prompt, greedy, no KV reuse: its answer depends on it alone."""
    text = " ".join(f"w{(variant * 11 + i * 7) % 120}" for i in range(n))
    sampling = SamplingParams(max_tokens=max_tokens)
    return GenerationRequest([TextSegment(text)], policy="full", sampling=sampling)


def test_a_step_failing_for_one_request_fails_that_request_alone(
    lm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = RecordingEngine(lm)
    step = batch_scheduler.decode_step

    def failing(model: LoadedModel, tokens: Sequence[int], kvs: Sequence[SeqKV]) -> torch.Tensor:
        bad = [call.kv for call in engine.calls if call.reserve == BAD]
        if any(kv is b for kv in kvs for b in bad):
            raise ValueError("this sequence cannot be decoded")
        return step(model, tokens, kvs)

    monkeypatch.setattr(batch_scheduler, "decode_step", failing)
    good = [plain(20, 1, max_tokens=30), plain(45, 2, max_tokens=25)]
    expected = [collect(LocalBackend(ChunkEngine(lm)).stream(r)) for r in good]
    backend = BatchingBackend(engine, max_batch=4)
    try:
        handles = [backend.submit(r) for r in good]
        firsts = [next(handle) for handle in handles]  # both decode in the batch now
        bad = backend.submit(plain(10, 3, max_tokens=BAD))
        with pytest.raises(ValueError, match="cannot be decoded"):
            list(bad)
        assert_read_on_as_alone(handles, firsts, expected)
    finally:
        assert backend.shutdown(timeout_s=TIMEOUT_S)
    metrics = backend.metrics()
    assert (metrics["finished_total"], metrics["failed_total"]) == (2, 1)


def test_a_step_failing_for_all_gives_each_request_its_own_error(
    lm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once three requests decode together every step fails, retried alone too. Each reader,
    in its own thread, gets an error object no other request holds, whose traceback shows
    its own reader once (a shared one collects every reader's frames)."""
    step = batch_scheduler.decode_step
    broken = threading.Event()

    def failing(model: LoadedModel, tokens: Sequence[int], kvs: Sequence[SeqKV]) -> torch.Tensor:
        if len(kvs) == 3:
            broken.set()
        if broken.is_set():
            raise RuntimeError("the decode step broke")
        return step(model, tokens, kvs)

    monkeypatch.setattr(batch_scheduler, "decode_step", failing)
    backend = BatchingBackend(ChunkEngine(lm), max_batch=4)
    try:
        handles = [backend.submit(plain(10 + i, i, max_tokens=200)) for i in range(3)]
        errors = read_in_threads(handles)
    finally:
        assert backend.shutdown(timeout_s=TIMEOUT_S)
    assert all(isinstance(error, RuntimeError) for error in errors), errors
    assert all(str(error) == "the decode step broke" for error in errors)
    assert len({id(error) for error in errors}) == 3
    for error in errors:
        assert error.__context__ is None and error.__cause__ is None
        frames = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
        assert frames.count("__next__") == 1
    assert backend.metrics()["failed_total"] == 3


def test_a_failed_requests_error_lets_its_tensors_go(
    lm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error a consumer keeps must not keep the failed step's tensors (its KV, on a real
    model up to hundreds of MB) alive through its traceback's frames."""
    held: list[weakref.ref[torch.Tensor]] = []

    def failing(model: LoadedModel, tokens: Sequence[int], kvs: Sequence[SeqKV]) -> torch.Tensor:
        scratch = torch.zeros(1024)  # stands for the step's own tensors
        held.append(weakref.ref(scratch))
        raise RuntimeError("the decode step broke")

    monkeypatch.setattr(batch_scheduler, "decode_step", failing)
    backend = BatchingBackend(ChunkEngine(lm), max_batch=4)
    try:
        [error] = read_in_threads([backend.submit(plain(10, 1, max_tokens=20))])
    finally:
        assert backend.shutdown(timeout_s=TIMEOUT_S)
    assert isinstance(error, RuntimeError)
    assert "failing" in [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    gc.collect()
    assert held and all(ref() is None for ref in held)

"""Shared test helpers around the engine and the batching backend: an engine that records
its prefills, decode steps held until released, and reading requests in threads."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from test_batching import collect

from chunkcache.core import batch_scheduler
from chunkcache.core.engine import ChunkEngine, Prefilled, TokenSegment
from chunkcache.core.generation import Policy
from chunkcache.core.kv_store import KVStore
from chunkcache.core.models import LoadedModel
from chunkcache.kernels.kv import SeqKV

TIMEOUT_S = 60


@dataclass
class PrefillCall:
    """One prefill the engine was asked for; ``kv`` is None until (unless) it succeeded."""

    tokens: int
    reserve: int
    kv: SeqKV | None = None


class RecordingEngine(ChunkEngine):
    """A :class:`ChunkEngine` that records every prefill it is asked for, refused ones too."""

    def __init__(self, lm: LoadedModel, store: KVStore | None = None) -> None:
        super().__init__(lm, store)
        self.calls: list[PrefillCall] = []

    def prefill(
        self,
        segments: Sequence[TokenSegment],
        policy: Policy,
        ratio: float = 0.15,
        conversation_id: str | None = None,
        reserve: int = 0,
    ) -> Prefilled:
        call = PrefillCall(sum(len(segment.ids) for segment in segments), reserve)
        self.calls.append(call)
        prefilled = super().prefill(segments, policy, ratio, conversation_id, reserve)
        call.kv = prefilled.kv
        return prefilled


def hold_decode_steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Batched decode steps wait until the yielded event is set (prefills and admissions go
    on); set on the way out. For a fixture: ``yield from hold_decode_steps(monkeypatch)``."""
    go = threading.Event()
    step = batch_scheduler.decode_step

    def held(*args: Any) -> Any:
        assert go.wait(timeout=TIMEOUT_S)
        return step(*args)

    monkeypatch.setattr(batch_scheduler, "decode_step", held)
    yield go
    go.set()


def start_readers(handles: Sequence[Any]) -> tuple[list[threading.Thread], list[Any]]:
    """Each handle read to its end in its own thread; the list fills with its (text, stats)
    or its error."""
    results: list[Any] = [None] * len(handles)

    def read(i: int) -> None:
        try:
            results[i] = collect(handles[i])
        except Exception as error:
            results[i] = error

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(handles))]
    for thread in threads:
        thread.start()
    return threads, results


def joined(threads: Sequence[threading.Thread]) -> None:
    """Wait for the reader threads (bounded): none may hang."""
    for thread in threads:
        thread.join(timeout=TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a request hung"


def read_in_threads(handles: Sequence[Any]) -> list[Any]:
    """:func:`start_readers`, then their results once all have ended."""
    threads, results = start_readers(handles)
    joined(threads)
    return results


def assert_read_on_as_alone(
    handles: Sequence[Any], firsts: Sequence[Any], expected: Sequence[tuple[str, Any]]
) -> None:
    """Each of the first ``len(expected)`` handles, read on after its first piece, gives the
    text and completion tokens the same request gave alone (``expected``: text, stats)."""
    for handle, first, (want_text, want) in zip(handles, firsts, expected, strict=False):
        text, stats = collect(handle)
        assert first.text + text == want_text
        assert stats.completion_tokens == want.completion_tokens

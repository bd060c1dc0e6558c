"""The requests of a :class:`~chunkcache.core.batching.BatchingBackend`: jobs, their consumers'
handles, and the cache-aware waiting queue (RAGCache §5.2)."""

from __future__ import annotations

import functools
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from chunkcache.core.engine import Prefilled, TokenSegment
from chunkcache.core.errors import BackendUnavailableError
from chunkcache.core.generation import GenerationChunk, GenerationRequest
from chunkcache.core.kv_store import KVStore, holds_segment
from chunkcache.core.store.reorder import CacheAwareQueue
from chunkcache.core.text_stream import TextStream

Event = GenerationChunk | BaseException


@dataclass(eq=False)
class Job:
    """One request inside the scheduler: its prompt, its state, and the events for its consumer.

    A running job has ``prefilled`` set and ``pending`` = the token sampled last, whose K/V
    the next batched decode step computes.
    """

    request: GenerationRequest
    segments: list[TokenSegment]
    text: TextStream
    submitted: float = field(default_factory=time.perf_counter)
    events: queue.SimpleQueue[Event] = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    admitted: float = 0.0
    prefilled: Prefilled | None = None
    pending: int = 0
    num_steps: int = 0  # batched decode steps this job took part in
    batch_rows: int = 0  # sum of those steps' batch sizes
    generator: torch.Generator | None = field(init=False)

    def __post_init__(self) -> None:
        seed = self.request.sampling.seed
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)

    @property
    def state(self) -> Prefilled:
        """The prefilled prompt and the tokens decoded so far (set once admitted)."""
        if self.prefilled is None:
            raise RuntimeError("the job has not been prefilled")
        return self.prefilled

    @property
    def done(self) -> bool:
        """EOS, a stop string, or ``max_tokens`` sampled."""
        return self.text.finished or len(self.text.tokens) >= self.request.sampling.max_tokens


class RequestHandle:
    """The consumer's side of a submitted request: an iterator over its generated pieces.

    The last piece carries the stats; an error inside the request (e.g. a prompt too long)
    is raised from the iteration, and :class:`BackendUnavailableError` once the scheduler
    thread is gone with the request unfinished. :meth:`close` (also :meth:`cancel`) cancels
    the request, and so does dropping the handle before its end, read or not: the scheduler
    holds only the :class:`Job`, so the handle's finalizer runs once its consumer lets go of
    it. A cancelled request leaves the queue or the batch at the scheduler's next step.
    """

    def __init__(self, job: Job, scheduler_alive: Callable[[], bool]) -> None:
        self._job = job
        self._scheduler_alive = scheduler_alive
        self._ended = False
        weakref.finalize(self, job.cancelled.set).atexit = False

    def cancel(self) -> None:
        """Stop generating for this request (no effect once it ended)."""
        self._job.cancelled.set()

    close = cancel  # the generator protocol's name: consumers close iterators they abandon

    def __iter__(self) -> RequestHandle:
        return self

    def __next__(self) -> GenerationChunk:
        if self._ended or self._job.cancelled.is_set():
            raise StopIteration
        event = self._next_event()
        if isinstance(event, BaseException):
            self._ended = True
            raise event
        self._ended = event.stats is not None
        return event

    def _next_event(self) -> Event:
        while True:
            try:
                return self._job.events.get(timeout=1.0)
            except queue.Empty:
                if self._job.cancelled.is_set():  # from another thread: no more events come
                    self._ended = True
                    raise StopIteration from None
                if self._scheduler_alive():
                    continue
            try:  # the scheduler's last act before it stopped may have been this job's end
                return self._job.events.get_nowait()
            except queue.Empty:
                self._ended = True
                raise BackendUnavailableError("the batching scheduler stopped") from None


class JobQueue(CacheAwareQueue[Job]):
    """:class:`CacheAwareQueue` of jobs that can also drop cancelled jobs and take new cached
    lengths for its waiting jobs (the store changes while they wait)."""

    def discard(self, drop: Callable[[Job], bool]) -> list[Job]:
        """Remove and return the waiting jobs for which ``drop`` is true."""
        drops = [drop(waiting.item) for waiting in self._waiting]  # once each: flags may flip
        dropped = [w.item for w, gone in zip(self._waiting, drops, strict=True) if gone]
        self._waiting = [w for w, gone in zip(self._waiting, drops, strict=True) if not gone]
        return dropped

    def contenders(self) -> list[Job]:
        """The waiting jobs whose cached lengths decide the next :meth:`pop`: none when one
        job waits, or when a starved one goes next whatever the lengths."""
        if len(self._waiting) < 2 or any(w.passed_by >= self.window for w in self._waiting):
            return []
        return [waiting.item for waiting in self._waiting]

    def refresh(self, counts: Mapping[Job, tuple[int, int]]) -> None:
        """Set the (cached, to compute) tokens of every waiting job in ``counts``; the others
        keep theirs."""
        for waiting in self._waiting:
            if waiting.item in counts:
                waiting.cached_tokens, waiting.compute_tokens = counts[waiting.item]


def cached_tokens(
    store: KVStore, fingerprint: str, segments: Sequence[TokenSegment]
) -> tuple[int, int]:
    """RAGCache's cached and computation lengths of a waiting prompt, estimated from the store:
    a segment counts as cached when any variant of it is stored (no loading, and no LRU touch
    in our stores). Selective recompute and a conversation's own past are not counted."""
    return _count(segments, functools.partial(holds_segment, store, fingerprint))


def cached_counts(
    store: KVStore, fingerprint: str, jobs: Sequence[Job]
) -> dict[Job, tuple[int, int]]:
    """:func:`cached_tokens` of every job, with one store lookup per distinct segment: the
    waiting prompts share their popular chunks and system text, and on a miss in the local
    tiers each lookup is a Redis round trip."""
    holds = functools.cache(functools.partial(holds_segment, store, fingerprint))
    return {job: _count(job.segments, holds) for job in jobs}


def _count(segments: Sequence[TokenSegment], holds: Callable[[str], bool]) -> tuple[int, int]:
    cached = sum(len(s.ids) for s in segments if holds(s.segment_id))
    return cached, sum(len(s.ids) for s in segments) - cached

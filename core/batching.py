"""The serving backend: one scheduler thread runs many requests on one :class:`ChunkEngine`.

The scheduler (:mod:`chunkcache.core.batch_scheduler`) batches continuously: every iteration
admits at most one waiting request and prefills it (with chunk-KV reuse, as
:class:`LocalBackend` does), then runs ONE batched decode step for every running request, so
requests join and leave the batch between steps. Waiting requests are admitted in RAGCache's
cache-aware order (§5.2, :class:`~chunkcache.core.store.reorder.CacheAwareQueue`: cached
length over computation length, a starvation window bounds how often one is passed over), and
their chunks are fetched up from slower tiers while they wait (RAG-DCache §III.B).

Measured 2026-11-23 on this machine (2-core AMD EPYC with AVX-512 bf16, no AMX;
SmolLM2-135M-Instruct bf16, torch on both threads, load average ~2.5 from other jobs). N short
chat requests, 64 greedy tokens each, all submitted at once; LocalBackend runs them one at a
time (tokens/s end to end, prefill included):

    N   LocalBackend   BatchingBackend   mean batch
    1   10.0           11.7              1.00
    4   10.6           43.3              3.92
    8   12.4           56.1              7.67

One decode step alone (sequences of 300-440 tokens): 80 / 100 / 132 ms for B = 1 / 4 / 8, i.e.
12.4 / 39.9 / 60.4 tokens/s. An earlier run on one thread at load ~6.5 gave the same shape
(7.7 / 5.5 / 6.3 against 6.8 / 19.1 / 37.8 tokens/s). A prefill still stalls the batch's
decoding while it runs (no chunked prefill).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from chunkcache.core.batch_queue import Job, RequestHandle, cached_tokens
from chunkcache.core.batch_scheduler import Scheduler
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.generation import GenerationRequest
from chunkcache.core.kv_store import KVStore
from chunkcache.core.local_backend import default_engine, fit_to_window
from chunkcache.core.store.hooks import prefetch
from chunkcache.core.text_stream import TextStream
from chunkcache.core.tokenization import SegmentTokenizer, render_chat


class BatchingBackend:
    """Runs requests concurrently on a :class:`ChunkEngine`: a bounded cache-aware queue in front
    of a continuous batch of up to ``max_batch`` decoding requests.

    Stats are those of :class:`LocalBackend` (times counted from :meth:`submit`), plus
    ``extra["queue_s"]`` (time waiting) and ``extra["batch_size"]`` (mean batch size over the
    request's decode steps; 0.0 if it ended at its first token). A request whose stream is
    closed or dropped before its end is cancelled and frees its batch slot; its KV is let go
    as it ends or leaves the batch, even while its consumer still holds the stream. A
    batched decode step that fails is taken again one request at a time: only the requests
    whose own step fails end, each raising its own error object. A backend dropped without
    :meth:`shutdown` shuts down as it is collected: the requests it runs and queues finish,
    then its scheduler thread ends and lets the engine go.
    """

    def __init__(
        self,
        engine: ChunkEngine,
        model_name: str = "chunkcache-local",
        max_queue: int = 64,
        max_batch: int = 8,
        starvation_window: int = 32,
    ) -> None:
        if engine.lm.tokenizer is None:
            raise ValueError("the batching backend needs a model loaded with its tokenizer")
        self.engine = engine
        self.model_name = model_name
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.tokenizer = engine.lm.tokenizer
        self.segment_tokenizer = SegmentTokenizer(self.tokenizer)
        self._scheduler = Scheduler(engine, max_queue, max_batch, starvation_window)
        # The scheduler's thread holds the scheduler, and it the engine (model, KV, store):
        # without this, a dropped backend (a model swapped for another) kept them all.
        weakref.finalize(self, _stop, self._scheduler).atexit = False

    @classmethod
    def default(
        cls,
        model: str | Path | None = None,
        dtype: torch.dtype = torch.bfloat16,
        store: KVStore | None = None,
        engine_options: Mapping[str, Any] | None = None,
        **limits: Any,
    ) -> BatchingBackend:
        """A backend on ``model`` (default: SmolLM2-135M-Instruct); ``engine_options`` go to
        :class:`ChunkEngine` (e.g. ``max_conversation_tokens``), ``limits`` are
        ``max_queue``, ``max_batch`` and ``starvation_window``."""
        return cls(*default_engine(model, dtype, store, engine_options), **limits)

    @property
    def context_window(self) -> int:
        return self.engine.lm.spec.context_window

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The model's chat template applied to ``messages``, ready for the assistant."""
        return render_chat(self.tokenizer, messages)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue ``request``; iterate the returned handle for its text, close it to cancel.

        Raises :class:`QueueFullError` (with a retry-after estimate) when ``max_queue``
        requests wait already, :class:`ShuttingDownError` once :meth:`shutdown` began,
        :class:`BackendUnavailableError` if the scheduler thread died,
        :class:`PromptTooLongError` when a ``fit_window`` prompt leaves no room to generate.
        """
        self._scheduler.check_open()  # refuse before tokenizing when we can
        segments = self.segment_tokenizer(request.segments)
        request = fit_to_window(request, segments, self.context_window)
        engine = self.engine.salted(request.cache_salt)  # its own salt's entries only
        chunk_ids = [segment.segment_id for segment in segments if segment.is_chunk]
        prefetch(engine.store, engine.namespace, chunk_ids)  # RAG-DCache §III.B
        stream = TextStream(self.tokenizer, engine.lm.eos_ids, request.sampling.stop)
        job = Job(request, segments, stream)
        self._scheduler.put(job, *cached_tokens(engine.store, engine.namespace, segments))
        return RequestHandle(job, self._scheduler.alive)

    def stream(self, request: GenerationRequest) -> RequestHandle:
        """:meth:`submit`: a full queue raises here, before any token; closing or dropping
        the returned iterator, even unread, cancels the request."""
        return self.submit(request)

    def metrics(self) -> dict[str, float]:
        """Queue and batch gauges and counters, for a Prometheus endpoint."""
        return self._scheduler.metrics()

    def shutdown(self, timeout_s: float = 30.0, drain: bool = True) -> bool:
        """Take no more requests; finish the running ones and, when ``drain``, the queued ones
        too (else they fail with :class:`ShuttingDownError`). True once the scheduler stopped."""
        return self._scheduler.shutdown(timeout_s, drain)


def _stop(scheduler: Scheduler) -> None:
    """Shut ``scheduler`` down without waiting: its backend is gone, so nobody submits,
    and the requests it holds (their consumers may still read) finish first."""
    # A cyclic collection may run this on the scheduler's own thread, which cannot join
    # itself (RuntimeError); it has been told to stop by then, all that is needed.
    with contextlib.suppress(RuntimeError):
        scheduler.shutdown(timeout_s=0.0, drain=True)

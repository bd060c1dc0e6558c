"""The serving backend: one scheduler thread runs many requests on one :class:`ChunkEngine`.

The loop is ``schedule -> run -> postprocess`` (nano-vllm's shape) with continuous batching:
every iteration admits at most one waiting request and prefills it (with chunk-KV reuse, as
:class:`LocalBackend` does), then runs ONE batched decode step
(:func:`~chunkcache.core.batch_step.decode_step`) for every running request, so requests join
and leave the batch between steps. Waiting requests are admitted in RAGCache's cache-aware
order (§5.2, :class:`~chunkcache.core.store.reorder.CacheAwareQueue`: cached length over
computation length, a starvation window bounds how often one is passed over), and their chunks
are fetched up from slower tiers while they wait (RAG-DCache §III.B).

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

import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from chunkcache.core.batch_queue import Job, JobQueue, RequestHandle, cached_tokens
from chunkcache.core.batch_step import decode_step
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.errors import QueueFullError, ShuttingDownError
from chunkcache.core.generation import GenerationChunk, GenerationRequest
from chunkcache.core.kv_store import KVStore
from chunkcache.core.model_files import DEFAULT_MODEL_NAME
from chunkcache.core.models import load_model
from chunkcache.core.sampling import sample_token
from chunkcache.core.store.hooks import prefetch
from chunkcache.core.text_stream import TextStream
from chunkcache.core.tokenization import SegmentTokenizer, render_chat

COUNTERS = (
    "requests_total",  # accepted by submit()
    "rejected_total",  # refused by submit(): queue full or shutting down
    "finished_total",  # ended with their stats
    "failed_total",  # ended with an error (their own, or rejected at shutdown)
    "cancelled_total",  # their consumer stopped reading
    "tokens_generated_total",
    "decode_steps_total",
    "decode_rows_total",  # sum of the decode steps' batch sizes
    "queue_seconds_sum",
)


class BatchingBackend:
    """Runs requests concurrently on a :class:`ChunkEngine`: a bounded cache-aware queue in front
    of a continuous batch of up to ``max_batch`` decoding requests.

    Stats are those of :class:`LocalBackend` (times counted from :meth:`submit`), plus
    ``extra["queue_s"]`` (time waiting) and ``extra["batch_size"]`` (mean batch size over the
    request's decode steps; 0.0 if it ended at its first token).
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
        if max_queue < 1 or max_batch < 1:
            raise ValueError(f"max_queue and max_batch must be >= 1, got {max_queue}, {max_batch}")
        self.engine = engine
        self.model_name = model_name
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.tokenizer = engine.lm.tokenizer
        self.segment_tokenizer = SegmentTokenizer(self.tokenizer)
        self._cond = threading.Condition()
        self._waiting = JobQueue(starvation_window)
        self._running: list[Job] = []
        self._stopping = False
        self._counts = dict.fromkeys(COUNTERS, 0.0)
        self._service_s: deque[float] = deque(maxlen=32)  # recent admission-to-end times
        self._thread = threading.Thread(target=self._loop, name="chunkcache-batching", daemon=True)
        self._thread.start()

    @classmethod
    def default(
        cls,
        model: str | Path | None = None,
        dtype: torch.dtype = torch.bfloat16,
        store: KVStore | None = None,
        **limits: Any,
    ) -> BatchingBackend:
        """A backend on ``model`` (default: SmolLM2-135M-Instruct); ``limits`` are
        ``max_queue``, ``max_batch`` and ``starvation_window``."""
        name = Path(model).name if model is not None else DEFAULT_MODEL_NAME
        return cls(ChunkEngine(load_model(model, dtype=dtype), store), name, **limits)

    @property
    def context_window(self) -> int:
        return self.engine.lm.spec.max_positions

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The model's chat template applied to ``messages``, ready for the assistant."""
        return render_chat(self.tokenizer, messages)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue ``request``; iterate the returned handle for its text.

        Raises :class:`QueueFullError` (with a retry-after estimate) when ``max_queue``
        requests wait already, :class:`ShuttingDownError` once :meth:`shutdown` began.
        """
        self._check_open()  # refuse before tokenizing when we can
        segments = self.segment_tokenizer(request.segments)
        lm = self.engine.lm
        chunk_ids = [segment.segment_id for segment in segments if segment.is_chunk]
        prefetch(self.engine.store, lm.fingerprint, chunk_ids)  # RAG-DCache §III.B
        text = TextStream(self.tokenizer, lm.eos_ids, request.sampling.stop)
        job = Job(request, segments, text)
        cached, compute = cached_tokens(self.engine.store, lm.fingerprint, segments)
        with self._cond:
            self._check_open()
            self._waiting.push(job, cached, compute)
            self._counts["requests_total"] += 1
            self._cond.notify()
        return RequestHandle(job, self._thread.is_alive)

    def stream(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        """:meth:`submit` then iterate: a full queue raises here, before any token."""
        return iter(self.submit(request))

    def metrics(self) -> dict[str, float]:
        """Queue and batch gauges and counters, for a Prometheus endpoint."""
        with self._cond:
            counts = dict(self._counts)
            counts["waiting"] = len(self._waiting)
            counts["running"] = len(self._running)
        counts["batch_size_mean"] = counts["decode_rows_total"] / max(
            1, counts["decode_steps_total"]
        )
        return counts

    def shutdown(self, timeout_s: float = 30.0, drain: bool = True) -> bool:
        """Take no more requests; finish the running ones and, when ``drain``, the queued ones
        too (else they fail with :class:`ShuttingDownError`). True once the scheduler stopped."""
        with self._cond:
            self._stopping = True
            shed = [] if drain else self._waiting.discard(lambda job: True)
            self._counts["failed_total"] += len(shed)
            self._cond.notify_all()
        for job in shed:
            job.events.put(ShuttingDownError("the backend shut down before the request ran"))
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _check_open(self) -> None:
        with self._cond:
            if self._stopping:
                self._counts["rejected_total"] += 1
                raise ShuttingDownError("the backend is shutting down")
            if len(self._waiting) >= self.max_queue:
                self._counts["rejected_total"] += 1
                raise QueueFullError(
                    f"{len(self._waiting)} requests are waiting already", self._retry_after()
                )

    def _retry_after(self) -> float:
        """Seconds until a queue slot likely frees: a running request ends about every
        (mean service time / requests running)."""
        if not self._service_s:
            return 1.0
        mean = sum(self._service_s) / len(self._service_s)
        return max(0.05, mean / max(1, len(self._running)))

    # The scheduler thread: everything below runs on it.

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or len(self._waiting) or self._running)
                self._drop_cancelled()
                if self._stopping and not self._waiting and not self._running:
                    return
                job = self._admit()
            if job is not None:
                self._prefill(job)
            if self._running:
                self._decode()

    def _drop_cancelled(self) -> None:
        gone = self._waiting.discard(lambda job: job.cancelled.is_set())
        gone += [job for job in self._running if job.cancelled.is_set()]
        self._running = [job for job in self._running if not job.cancelled.is_set()]
        self._counts["cancelled_total"] += len(gone)

    def _admit(self) -> Job | None:
        """Pop the waiting request to run next (RAGCache §5.2), if the batch has room."""
        if len(self._running) >= self.max_batch or not len(self._waiting):
            return None
        store, fingerprint = self.engine.store, self.engine.lm.fingerprint
        self._waiting.refresh(lambda job: cached_tokens(store, fingerprint, job.segments))
        job = self._waiting.pop()
        job.admitted = time.perf_counter()
        self._counts["queue_seconds_sum"] += job.admitted - job.submitted
        return job

    def _prefill(self, job: Job) -> None:
        request = job.request
        try:
            job.prefilled = self.engine.prefill(
                job.segments,
                request.policy,
                request.recompute_ratio,
                request.conversation_id,
                reserve=request.sampling.max_tokens,
            )
            self._sample(job, job.prefilled.logits)
        except Exception as error:  # the request's own failure, e.g. PromptTooLongError
            self._fail(job, error)
            return
        if job.done:
            self._finish(job)
        else:
            with self._cond:
                self._running.append(job)

    def _decode(self) -> None:
        """One batched decode step for every running request, then sample each one's next."""
        batch = list(self._running)
        try:
            logits = decode_step(
                self.engine.lm, [job.pending for job in batch], [job.state.kv for job in batch]
            )  # logits: [B, V]
        except Exception as error:
            for job in batch:
                self._fail(job, error)
            return
        with self._cond:
            self._counts["decode_steps_total"] += 1
            self._counts["decode_rows_total"] += len(batch)
        for row, job in enumerate(batch):
            job.state.ids.append(job.pending)
            job.num_steps, job.batch_rows = job.num_steps + 1, job.batch_rows + len(batch)
            try:
                self._sample(job, logits[row])
            except Exception as error:
                self._fail(job, error)
                continue
            if job.done:
                self._finish(job)

    def _sample(self, job: Job, logits: torch.Tensor) -> None:
        # logits: [V] float32
        token = sample_token(logits, job.request.sampling, job.generator)
        if not job.text.tokens and not job.text.finished:
            job.state.stats.ttft_s = time.perf_counter() - job.submitted
        piece = job.text.push(token)
        job.pending = token
        with self._cond:
            self._counts["tokens_generated_total"] += 1
        if piece:
            job.events.put(GenerationChunk(piece))

    def _finish(self, job: Job) -> None:
        if job.request.conversation_id is not None:
            self.engine.remember(job.request.conversation_id, job.state)
        final = job.text.finish()
        stats, now = job.state.stats, time.perf_counter()
        stats.finish_reason = job.text.finish_reason
        stats.completion_tokens = len(job.text.tokens)
        stats.total_s = now - job.submitted
        stats.extra["queue_s"] = job.admitted - job.submitted
        stats.extra["batch_size"] = job.batch_rows / job.num_steps if job.num_steps else 0.0
        self._end(job, "finished_total", now)
        job.events.put(GenerationChunk(final, stats))

    def _fail(self, job: Job, error: BaseException) -> None:
        self._end(job, "failed_total", time.perf_counter())
        job.events.put(error)

    def _end(self, job: Job, counter: str, now: float) -> None:
        with self._cond:
            self._counts[counter] += 1
            self._service_s.append(now - job.admitted)
            if job in self._running:
                self._running.remove(job)

"""The scheduler thread of :class:`~chunkcache.core.batching.BatchingBackend`: admission to a
bounded queue, the continuous-batching loop, and its counters.

Each iteration drops cancelled jobs, admits at most one waiting job in RAGCache's cache-aware
order (§5.2) and prefills it, then runs ONE batched decode step
(:func:`~chunkcache.core.batch_step.decode_step`) for every running job, so jobs join and leave
the batch between steps (nano-vllm's ``schedule -> run -> postprocess``).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque

import torch

from chunkcache.core.batch_queue import Job, JobQueue, cached_counts
from chunkcache.core.batch_step import decode_step
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.errors import BackendUnavailableError, QueueFullError, ShuttingDownError
from chunkcache.core.generation import GenerationChunk
from chunkcache.core.sampling import sample_token

log = logging.getLogger(__name__)

COUNTERS = (
    "requests_total",  # accepted by submit()
    "rejected_total",  # refused by submit(): queue full or shutting down
    "finished_total",  # ended with their stats
    "failed_total",  # ended with an error (their own, or rejected at shutdown)
    "cancelled_total",  # their consumer stopped reading, closed or dropped the stream
    "tokens_generated_total",
    "decode_steps_total",
    "decode_rows_total",  # sum of the decode steps' batch sizes
    "queue_seconds_sum",
)


class Scheduler:
    """Owns the waiting queue, the running batch and the thread that advances them."""

    def __init__(
        self, engine: ChunkEngine, max_queue: int, max_batch: int, starvation_window: int
    ) -> None:
        if max_queue < 1 or max_batch < 1:
            raise ValueError(f"max_queue and max_batch must be >= 1, got {max_queue}, {max_batch}")
        self.engine = engine
        self.max_queue = max_queue
        self.max_batch = max_batch
        self._cond = threading.Condition()
        self._waiting = JobQueue(starvation_window)
        self._running: list[Job] = []
        self._starting = 0  # admitted, prefilling: in the batch's room, not in _running yet
        self._stopping = False
        self._counts = dict.fromkeys(COUNTERS, 0.0)
        self._service_s: deque[float] = deque(maxlen=32)  # recent admission-to-end times
        self._thread = threading.Thread(target=self._loop, name="chunkcache-batching", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        """The scheduler thread still runs."""
        return self._thread.is_alive()

    def check_open(self) -> None:
        """Raise :class:`ShuttingDownError` or :class:`QueueFullError` if a job would be refused:
        ``max_batch + max_queue`` jobs are in flight already (waiting jobs beyond
        ``max_queue`` are those the batch has room for and has not admitted yet);
        :class:`BackendUnavailableError` if the scheduler thread died (nobody would run it)."""
        with self._cond:
            if self._stopping:
                self._counts["rejected_total"] += 1
                raise ShuttingDownError("the backend is shutting down")
            if not self.alive():
                self._counts["rejected_total"] += 1
                raise BackendUnavailableError("the batching scheduler stopped")
            self._drop_cancelled_waiting()
            batch_room = max(0, self.max_batch - len(self._running) - self._starting)
            if len(self._waiting) >= self.max_queue + batch_room:
                self._counts["rejected_total"] += 1
                raise QueueFullError(
                    f"{len(self._waiting)} requests are waiting already", self._retry_after()
                )

    def put(self, job: Job, cached: int, compute: int) -> None:
        """Queue ``job`` with its cached and to-compute prompt tokens, unless refused."""
        with self._cond:
            self.check_open()
            self._waiting.push(job, cached, compute)
            self._counts["requests_total"] += 1
            self._cond.notify()

    def metrics(self) -> dict[str, float]:
        """The counters, plus the ``waiting``, ``running`` (a request in its prefill too) and
        ``batch_size_mean`` gauges: ``requests_total`` is always the ended requests
        (finished, failed, cancelled) plus the waiting and running ones."""
        with self._cond:
            counts = dict(self._counts)
            counts["waiting"] = len(self._waiting)
            counts["running"] = len(self._running) + self._starting  # a prefill runs too
        counts["batch_size_mean"] = counts["decode_rows_total"] / max(
            1, counts["decode_steps_total"]
        )
        return counts

    def shutdown(self, timeout_s: float, drain: bool) -> bool:
        """Take no more jobs; run the running ones and (``drain``) the waiting ones to their
        end, else fail those with :class:`ShuttingDownError`. True once the thread stopped."""
        with self._cond:
            self._stopping = True
            shed = [] if drain else self._waiting.discard(lambda job: True)
            self._counts["failed_total"] += len(shed)
            self._cond.notify_all()
        for job in shed:
            job.events.put(ShuttingDownError("the backend shut down before the request ran"))
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

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
                room = len(self._running) < self.max_batch and len(self._waiting) > 0
                contenders = self._waiting.contenders() if room else []
            job = self._admit(contenders) if room else None
            if job is not None:
                self._prefill(job)
            if self._running:
                self._decode()

    def _drop_cancelled(self) -> None:
        self._drop_cancelled_waiting()
        gone = [job for job in self._running if job.cancelled.is_set()]
        self._running = [job for job in self._running if not job.cancelled.is_set()]
        self._counts["cancelled_total"] += len(gone)
        for job in gone:
            job.prefilled = None  # its KV: the consumer may hold its handle for long

    def _drop_cancelled_waiting(self) -> None:
        """Under ``_cond``: forget waiting jobs whose consumer left (any thread may)."""
        gone = self._waiting.discard(lambda job: job.cancelled.is_set())
        self._counts["cancelled_total"] += len(gone)

    def _admit(self, contenders: list[Job]) -> Job | None:
        """Pop the waiting job to run next (RAGCache §5.2), once the ``contenders``' cached
        lengths are read again from the store (it changed while they waited).

        The store is read outside the lock, one lookup per distinct segment: with a Redis
        tier each segment the local tiers miss is a round trip (SMEMBERS, ~0.12 ms on
        loopback). 64 waiting prompts of 7 segments took 34 ms per admission (22 ms with each
        segment once; measured 2026-11), and under the lock every submit and metrics read
        waited that long. Jobs queued meanwhile keep the lengths :meth:`put` was given; jobs
        cancelled or shed meanwhile are not admitted."""
        try:
            counts = self._cached_counts(contenders)
        except Exception:  # a store that fails (a user's KVStore): order by the lengths at put
            log.warning("chunkcache batching: reading cached lengths failed", exc_info=True)
            counts = {}
        with self._cond:
            self._drop_cancelled_waiting()
            if not len(self._waiting):  # cancelled, or shed by shutdown(drain=False)
                return None
            self._waiting.refresh(counts)
            job = self._waiting.pop()
            self._starting = 1
            job.admitted = time.perf_counter()
            self._counts["queue_seconds_sum"] += job.admitted - job.submitted
        return job

    def _cached_counts(self, jobs: list[Job]) -> dict[Job, tuple[int, int]]:
        """:func:`cached_counts` of ``jobs``, each counted in its own salt's namespace: a job
        is never ordered by what another salt's requests cached."""
        by_salt: dict[str | None, list[Job]] = {}
        for job in jobs:
            by_salt.setdefault(job.request.cache_salt, []).append(job)
        counts: dict[Job, tuple[int, int]] = {}
        for salt, salted_jobs in by_salt.items():
            engine = self.engine.salted(salt)
            counts.update(cached_counts(engine.store, engine.namespace, salted_jobs))
        return counts

    def _prefill(self, job: Job) -> None:
        request = job.request
        try:
            job.prefilled = self.engine.salted(request.cache_salt).prefill(
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
            return
        with self._cond:  # one step: its place moves from starting to running
            self._starting = 0
            self._running.append(job)

    def _decode(self) -> None:
        """One batched decode step for every running job, then sample each one's next.

        Should the step fail, each job steps again alone (the failed step left their KV as it
        was), so only the jobs whose own step fails end, each with its own error: one error
        object handed to several consumers would be raised in each of their threads, each
        raise rewriting its ``__traceback__`` and ``__context__``."""
        batch = list(self._running)
        logits = self._step(batch)
        if isinstance(logits, Exception) and len(batch) > 1:
            steps = [([job], self._step([job])) for job in batch]
        else:
            steps = [(batch, logits)]
        for jobs, result in steps:
            if isinstance(result, Exception):
                self._fail(jobs[0], result)  # a step that fails here ran one job alone
            else:
                self._advance(jobs, result)

    def _step(self, jobs: list[Job]) -> torch.Tensor | Exception:
        """The jobs' next-token logits ``[B, V]`` after their pending tokens, or what the
        step raised (returned, so a retry's error does not chain to the batch's)."""
        try:
            return decode_step(
                self.engine.lm, [job.pending for job in jobs], [job.state.kv for job in jobs]
            )
        except Exception as error:
            return error

    def _advance(self, jobs: list[Job], logits: torch.Tensor) -> None:
        """Count the step of ``jobs`` and sample each one's next token from its row."""
        # logits: [B, V]
        with self._cond:
            self._counts["decode_steps_total"] += 1
            self._counts["decode_rows_total"] += len(jobs)
        for row, job in enumerate(jobs):
            job.state.append(job.pending)
            job.num_steps, job.batch_rows = job.num_steps + 1, job.batch_rows + len(jobs)
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
        try:
            final = job.text.finish()
            if job.request.conversation_id is not None:
                engine = self.engine.salted(job.request.cache_salt)
                engine.remember(job.request.conversation_id, job.state)
        except Exception as error:  # e.g. MemoryError copying the KV out: this request's own,
            self._fail(job, error)  # raised on this thread it would stop the scheduler
            return
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
        # The traceback's frames hold the failed step's tensors (the job's KV among them)
        # for as long as the consumer keeps the error; lines and names stay for printing.
        traceback.clear_frames(error.__traceback__)
        job.events.put(error)

    def _end(self, job: Job, counter: str, now: float) -> None:
        with self._cond:
            self._counts[counter] += 1
            self._service_s.append(now - job.admitted)
            if job in self._running:
                self._running.remove(job)
            else:  # it ended in its prefill: counted as starting until now, never unaccounted
                self._starting = 0
        job.prefilled = None  # its KV (a conversation's own stays in the engine)

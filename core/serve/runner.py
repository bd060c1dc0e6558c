"""Runs generation requests for the server: admission, a worker thread each, async pieces.

The engine is blocking, so every request's ``backend.stream`` runs in its own worker
thread (:func:`~chunkcache.core.prompting.aiterate`) and the event loop never waits on
it.  Admission is bounded: at most ``max_batch + max_queue`` requests are in flight; one
more is refused with :class:`QueueFullError` (a 429) before it costs anything.  A backend
with its own queue (continuous batching) may refuse too, before its first token.  After
:meth:`Runner.close` new requests get :class:`ShuttingDownError` (a 503).

A request closed before its end (its client left) closes the backend's stream.  A stream
with a thread-safe ``cancel()`` (the batching and local backends') is also cancelled at once
from the event loop, even while its worker waits for a piece (queued, waiting for the
engine, or in prefill): it then stops without waiting for its next token.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable

from chunkcache.core.errors import QueueFullError, ShuttingDownError
from chunkcache.core.generation import Backend, GenerationChunk, GenerationRequest
from chunkcache.core.prompting import aiterate
from chunkcache.core.serve.metrics import ServeMetrics

EMA_WEIGHT = 0.2  # of the newest request in the running mean of request seconds


class Ticket:
    """One admitted request's place, given back exactly once with the request's outcome
    (``completed``, ``failed``, ``refused``; ``cancelled`` when dropped unreleased), or
    withdrawn uncounted when the request was refused before it reached the backend."""

    def __init__(self, runner: Runner) -> None:
        self._runner: Runner | None = runner

    def release(self, outcome: str | None = "cancelled") -> None:
        """Give the place back, counting a generation with ``outcome`` unless it is None."""
        runner, self._runner = self._runner, None
        if runner is not None:
            runner._leave(outcome)

    def withdraw(self) -> None:
        """Give the place back uncounted: the request never reached the backend."""
        self.release(None)

    def __del__(self) -> None:
        # The garbage collector runs this on whatever thread allocates, maybe one that holds
        # the runner's or the metrics' lock (neither is reentrant): take neither here.
        runner, self._runner = self._runner, None
        if runner is not None:
            runner._dropped.append(None)  # deque.append is atomic


class Runner:
    """Admits requests up to a bound and streams their pieces from worker threads."""

    def __init__(
        self,
        backend: Backend,
        metrics: ServeMetrics,
        max_in_flight: int,
        parallel: int = 1,
        retry_after_s: float = 1.0,
    ) -> None:
        self.backend = backend
        self.metrics = metrics
        self.max_in_flight = max_in_flight
        self.parallel = parallel
        self.retry_after_s = retry_after_s
        self.closing = False
        self._in_flight = 0
        self._mean_request_s = retry_after_s
        self._lock = threading.Lock()
        self._dropped: deque[None] = deque()  # places of tickets dropped unreleased

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet left."""
        with self._lock:
            dropped = self._take_dropped()
            in_flight = self._in_flight
        self._count_cancelled(dropped)
        return in_flight

    def admit(self) -> Ticket:
        """A place for one request, or QueueFullError / ShuttingDownError."""
        with self._lock:
            dropped = self._take_dropped()
            refusal = self._refusal()
            if refusal is None:
                self._in_flight += 1
        self._count_cancelled(dropped)
        if refusal is not None:
            raise refusal
        return Ticket(self)

    def _refusal(self) -> QueueFullError | ShuttingDownError | None:
        """Why a request cannot be admitted now, if it cannot (under the lock)."""
        if self.closing:
            return ShuttingDownError("the server is shutting down")
        if self._in_flight < self.max_in_flight:
            return None
        waiting = self._in_flight - self.parallel + 1
        retry = max(self.retry_after_s, self._mean_request_s * waiting / self.parallel)
        return QueueFullError(
            f"{self._in_flight} requests in flight, the most this server takes",
            retry_after_s=math.ceil(retry),
        )

    def _leave(self, outcome: str | None) -> None:
        with self._lock:
            self._in_flight -= 1
        if outcome is not None:
            self.metrics.inc(
                "chunkcache_generations_total", "generations by outcome", outcome=outcome
            )

    def _take_dropped(self) -> int:
        """Give back the places of tickets dropped unreleased since the last call (under
        the lock); their number."""
        count = 0
        while self._dropped:
            self._dropped.popleft()
            count += 1
        self._in_flight -= count
        return count

    def _count_cancelled(self, count: int) -> None:
        if count:
            self.metrics.inc(
                "chunkcache_generations_total", "generations by outcome", count, outcome="cancelled"
            )

    async def open(
        self, request: GenerationRequest, ticket: Ticket | None = None
    ) -> AsyncGenerator[GenerationChunk]:
        """Admit ``request`` (unless its ``ticket`` was taken already) and run it up to its
        first piece, so a refusal or bad input raises here, before any response starts; the
        returned iterator yields every piece (the last carries the stats).  Closing it early
        closes the backend's stream."""
        ticket = self.admit() if ticket is None else ticket
        try:
            source = iter(await asyncio.to_thread(self.backend.stream, request))
        except BaseException as error:
            ticket.release(_outcome(error))
            if isinstance(error, QueueFullError):  # the backend's own queue: our least wait
                error.retry_after_s = max(error.retry_after_s, self.retry_after_s)
            raise
        cancel: Callable[[], None] = getattr(source, "cancel", _nothing)
        pieces = aiterate(source)
        try:
            first = await _next_piece(pieces)
        except BaseException as error:
            ticket.release(_outcome(error))
            cancel()
            await pieces.aclose()
            raise
        return self._rest(ticket, first, pieces, cancel)

    async def _rest(
        self,
        ticket: Ticket,
        first: GenerationChunk,
        pieces: AsyncGenerator[GenerationChunk],
        cancel: Callable[[], None],
    ) -> AsyncGenerator[GenerationChunk]:
        """Every piece from ``first`` on.  Closed or dropped before its end, the request
        counts as cancelled (the ticket's default), is cancelled and ``pieces`` closes the
        backend's stream (explicitly here, or by asyncio's async-generator finalizer when
        this generator never started)."""
        try:
            piece = first
            while piece.stats is None:
                yield piece
                piece = await _next_piece(pieces)
            # Counted before the last piece goes out: its consumer may stop right there.
            self._finished(piece.stats.total_s)
            self.metrics.generation(piece.stats)
            ticket.release("completed")
            yield piece
        except Exception:
            ticket.release("failed")
            raise
        finally:
            ticket.release()
            cancel()  # no effect once it ended
            await pieces.aclose()

    def _finished(self, seconds: float) -> None:
        with self._lock:
            self._mean_request_s += EMA_WEIGHT * (seconds - self._mean_request_s)

    def close(self) -> None:
        """Refuse new requests from now on (those in flight go on)."""
        with self._lock:
            self.closing = True


async def _next_piece(pieces: AsyncGenerator[GenerationChunk]) -> GenerationChunk:
    piece = await anext(pieces, None)
    if piece is None:
        raise RuntimeError("the backend's stream ended without stats")
    return piece


def _outcome(error: BaseException) -> str:
    """How a request that failed before its first piece counts."""
    if isinstance(error, QueueFullError):
        return "refused"
    return "cancelled" if isinstance(error, asyncio.CancelledError) else "failed"


def _nothing() -> None:
    """The ``cancel`` of a stream that has none: closing it is all there is."""

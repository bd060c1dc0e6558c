"""Cache-aware request reordering with a starvation window (RAGCache §5.2).

Waiting requests are served by ``OrderPriority = cached length / computation length``: a
request with more of its context cached (Figure 12a) or less to recompute (Figure 12b) goes
first, since serving it before the cache churns saves the most compute.  No request waits
behind more than ``window`` later arrivals: once ``window`` requests that came after it have
been served, it is served next.

A server with a queue pushes each request with the cached and uncached token counts the
store reports for it (e.g. from :meth:`TieredKVStore.exact` / ``variants`` lookups, or the
planner's estimate) and pops the next one to run; nothing here touches the engine.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(order=True)
class _Waiting(Generic[T]):
    arrival: int
    cached_tokens: int = field(compare=False)
    compute_tokens: int = field(compare=False)
    item: T = field(compare=False)
    passed_by: int = field(default=0, compare=False)

    @property
    def order_priority(self) -> float:
        return self.cached_tokens / max(1, self.compute_tokens)


class CacheAwareQueue(Generic[T]):
    """A request queue ordered by RAGCache's OrderPriority, with a starvation window."""

    def __init__(self, window: int = 32) -> None:
        if window < 1:
            raise ValueError("window must be positive")
        self.window = window
        self._waiting: list[_Waiting[T]] = []
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    def push(self, item: T, cached_tokens: int, compute_tokens: int) -> None:
        """Queue ``item``, whose prompt has ``cached_tokens`` hits and ``compute_tokens`` to
        compute (misses plus tokens to recompute)."""
        self._waiting.append(_Waiting(next(self._arrivals), cached_tokens, compute_tokens, item))

    def update(self, item: T, cached_tokens: int, compute_tokens: int) -> None:
        """New counts for a waiting item (the cache changed while it waited)."""
        for waiting in self._waiting:
            if waiting.item is item or waiting.item == item:
                waiting.cached_tokens, waiting.compute_tokens = cached_tokens, compute_tokens

    def pop(self) -> T:
        """The next request: the oldest starved one, else the highest OrderPriority (the
        earlier arrival on a tie)."""
        if not self._waiting:
            raise IndexError("pop from an empty queue")
        starved = [w for w in self._waiting if w.passed_by >= self.window]
        if starved:
            chosen = min(starved)
        else:
            chosen = max(self._waiting, key=lambda w: (w.order_priority, -w.arrival))
        self._waiting.remove(chosen)
        for waiting in self._waiting:
            if waiting.arrival < chosen.arrival:
                waiting.passed_by += 1
        return chosen.item

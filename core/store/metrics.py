"""Store counters: per tier, for the whole process and for one request.

:class:`StoreMetrics` counts for the process.  :func:`track` opens a per-request
:class:`StoreUsage` in a context variable: every count made by this thread (or task) while it
is open also lands there, so concurrent requests each see only their own hits, misses and
load seconds, which the engine can put into ``GenerationStats.extra``.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

TIER_COUNTERS = (
    "hits",
    "misses",
    "evictions",
    "demotions",
    "promotions",
    "prefetched",
    "corrupt_dropped",
    "load_seconds",
    "bytes_loaded",
    "errors",
    "backfilled",
)
# write_through_skipped: puts whose write-through the backlog's cap turned away
STORE_COUNTERS = ("lookups", "hits", "misses", "puts", "write_through_skipped")


class StoreUsage:
    """Counts for one request (or any span of work): ``{"tiers": {name: {...}}, ...}``."""

    def __init__(self, tiers: list[str]) -> None:
        self.tiers: dict[str, dict[str, float]] = {
            t: dict.fromkeys(TIER_COUNTERS, 0) for t in tiers
        }
        self.totals: dict[str, float] = dict.fromkeys(STORE_COUNTERS, 0)

    def as_dict(self) -> dict[str, Any]:
        """Only what is non-zero, tiers nested; load seconds rounded to microseconds."""
        tiers = {
            name: {k: _round(v) for k, v in counts.items() if v}
            for name, counts in self.tiers.items()
        }
        out: dict[str, Any] = {k: v for k, v in self.totals.items() if v}
        out["tiers"] = {name: counts for name, counts in tiers.items() if counts}
        return out


# Every usage open in this context (nested spans each count: the engine tracks each
# request, and a caller may track several requests around it).
_current: contextvars.ContextVar[tuple[StoreUsage, ...]] = contextvars.ContextVar(
    "chunkcache_store_usage", default=()
)


class StoreMetrics:
    """Thread-safe process-wide counters; every count also goes to the open request."""

    def __init__(self, tiers: list[str]) -> None:
        self.tier_names = list(tiers)
        self._total = StoreUsage(tiers)
        self._lock = threading.Lock()

    def tier(self, tier: str, counter: str, amount: float = 1) -> None:
        with self._lock:
            self._total.tiers[tier][counter] += amount
        for usage in _current.get():
            if tier in usage.tiers:
                usage.tiers[tier][counter] += amount

    def store(self, counter: str, amount: float = 1) -> None:
        with self._lock:
            self._total.totals[counter] += amount
        for usage in _current.get():
            usage.totals[counter] += amount

    def snapshot(self) -> dict[str, Any]:
        """A copy of every counter (zeros included): ``{"tiers": {...}, "lookups": ...}``."""
        with self._lock:
            out: dict[str, Any] = dict(self._total.totals)
            out["tiers"] = {name: dict(c) for name, c in self._total.tiers.items()}
        return out

    @contextmanager
    def track(self) -> Iterator[StoreUsage]:
        """Count this request's store work apart: ``with metrics.track() as usage: ...``."""
        usage = StoreUsage(self.tier_names)
        token = _current.set((*_current.get(), usage))
        try:
            yield usage
        finally:
            _current.reset(token)


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``after - before`` of two snapshots, zeros left out (for single-threaded callers;
    concurrent requests should use :meth:`StoreMetrics.track`)."""
    out: dict[str, Any] = {
        k: _round(v - before.get(k, 0))
        for k, v in after.items()
        if k != "tiers" and v != before.get(k, 0)
    }
    tiers = {}
    for name, counts in after.get("tiers", {}).items():
        old = before.get("tiers", {}).get(name, {})
        changed = {k: _round(v - old.get(k, 0)) for k, v in counts.items() if v != old.get(k, 0)}
        if changed:
            tiers[name] = changed
    out["tiers"] = tiers
    return out


def _round(value: float) -> float:
    return round(value, 6) if isinstance(value, float) else value

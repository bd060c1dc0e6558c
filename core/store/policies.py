"""Eviction policies: tiny strategy classes chosen by name (SGLang ``evict_policy.py`` style).

Each tier owns one policy instance (so PGDSF keeps one clock per tier, as RAGCache keeps
one for GPU and one for host memory).  The store keeps an :class:`EntryStats` per entry,
shared by every tier, and asks the policy of the full tier for the entry to evict among
that tier's entries: the one with the smallest :meth:`EvictionPolicy.sort_key`.

- ``lru``: least recently used first.
- ``lfu``: least frequently used first, least recent among equals.
- ``pgdsf``: RAGCache's prefix-aware Greedy-Dual-Size-Frequency (§5.1, Formula 2-4,
  Algorithm 1): priority = clock + frequency x cost / size, where cost / size is the average
  measured prefill seconds per non-cached token over the requests that missed the entry
  (Formula 4); the tier's clock rises to the priority of each evicted entry (Formula 3).
- ``cachecraft``: Cache-Craft §3.3: lowest frequency-reuse f_r = sum over reuses of 1 / CFO
  first, least recent among equals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from chunkcache.core.kv_store import ReuseCount
from chunkcache.core.store.codec import EntryKey


@dataclass
class EntryStats:
    """What the policies know about one stored variant, whatever tier holds it."""

    num_bytes: int
    num_tokens: int
    last_used: int = 0  # logical tick of the last put or hit
    frequency: int = 0  # puts and hits (RAGCache: retrievals), reset on restart
    cost_total: float = 0.0  # sum over missing requests of seconds / non-cached tokens
    num_costs: int = 0  # m of Formula 4
    reuse: ReuseCount = field(default_factory=ReuseCount)
    names: tuple[str, str, str] | None = None  # (fingerprint, segment_id, context) if seen

    @property
    def cost_per_token(self) -> float | None:
        """Formula 4: (1/m) sum_i Cost_i / NewSize_i, or None before any measurement."""
        return self.cost_total / self.num_costs if self.num_costs else None

    def record_cost(self, seconds: float, new_tokens: int) -> None:
        """One request that had to compute this entry took ``seconds`` for ``new_tokens``."""
        if new_tokens > 0 and seconds >= 0:
            self.cost_total += seconds / new_tokens
            self.num_costs += 1


class EvictionPolicy:
    """Base class: evict the entry with the smallest :meth:`sort_key`."""

    name: ClassVar[str] = ""

    def sort_key(self, key: EntryKey, stats: EntryStats) -> tuple[float, ...]:
        raise NotImplementedError

    def touched(self, key: EntryKey, stats: EntryStats) -> None:
        """``key`` entered this tier or was hit in it."""

    def forget(self, key: EntryKey) -> None:
        """``key`` left this tier."""

    def victim(
        self, keys: Iterable[EntryKey], stats_of: Callable[[EntryKey], EntryStats]
    ) -> EntryKey:
        """The entry to evict next among ``keys`` (linear scan: tiers hold thousands)."""
        return min(keys, key=lambda key: (self.sort_key(key, stats_of(key)), key))

    def evicted(self, key: EntryKey, stats: EntryStats) -> None:
        """``key`` was chosen and removed."""
        self.forget(key)


class LRUPolicy(EvictionPolicy):
    """Evict the least recently used entry."""

    name = "lru"

    def sort_key(self, key: EntryKey, stats: EntryStats) -> tuple[float, ...]:
        return (stats.last_used,)


class LFUPolicy(EvictionPolicy):
    """Evict the least frequently used entry (the least recently used among ties)."""

    name = "lfu"

    def sort_key(self, key: EntryKey, stats: EntryStats) -> tuple[float, ...]:
        return (stats.frequency, stats.last_used)


class PGDSFPolicy(EvictionPolicy):
    """RAGCache PGDSF (§5.1).  ``default_cost`` gives the cost per token of an entry no
    request has measured yet (default 1.0: cost proportional to size, RAGCache's GDSF
    baseline); pass e.g. :meth:`PrefillCostModel.per_token` to estimate it from a profile."""

    name = "pgdsf"

    def __init__(self, default_cost: Callable[[EntryStats], float] | None = None) -> None:
        self.clock = 0.0
        self.default_cost = default_cost
        self._priority: dict[EntryKey, float] = {}

    def cost_per_token(self, stats: EntryStats) -> float:
        """The entry's measured prefill cost per token, else the default estimate."""
        measured = stats.cost_per_token
        if measured is not None:
            return measured
        return self.default_cost(stats) if self.default_cost is not None else 1.0

    def touched(self, key: EntryKey, stats: EntryStats) -> None:
        # Algorithm 1 line 9: Priority <- Clock + AvgCost x Frequency (Formula 2 with 4)
        self._priority[key] = self.clock + max(1, stats.frequency) * self.cost_per_token(stats)

    def priority(self, key: EntryKey, stats: EntryStats) -> float:
        """The entry's PGDSF priority (lowest is evicted first)."""
        if key not in self._priority:
            self.touched(key, stats)
        return self._priority[key]

    def sort_key(self, key: EntryKey, stats: EntryStats) -> tuple[float, ...]:
        return (self.priority(key, stats), stats.last_used)

    def evicted(self, key: EntryKey, stats: EntryStats) -> None:
        # Formula 3 / Algorithm 1 line 17: Clock <- max(Clock, evicted priority)
        self.clock = max(self.clock, self.priority(key, stats))
        self.forget(key)

    def forget(self, key: EntryKey) -> None:
        self._priority.pop(key, None)


class CacheCraftPolicy(EvictionPolicy):
    """Cache-Craft §3.3: evict the variant with the lowest frequency-reuse f_r."""

    name = "cachecraft"

    def sort_key(self, key: EntryKey, stats: EntryStats) -> tuple[float, ...]:
        return (stats.reuse.frequency_reuse, stats.last_used)


POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, LFUPolicy, PGDSFPolicy, CacheCraftPolicy)
}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by name: ``lru``, ``lfu``, ``pgdsf`` or ``cachecraft``."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; one of {sorted(POLICIES)}") from None

"""The tiered store's per-entry statistics: what every tier's eviction policy reads.

One :class:`~chunkcache.core.store.policies.EntryStats` per entry the store knows, whatever
tier holds it: last use, frequency, size, PGDSF's measured cost (RAGCache §5.1) and the one
live reuse counter a copy loaded from below shares (Cache-Craft §3.3).  Statistics of
entries no local tier holds any more are pruned once they outnumber the entries.

The statistics also index the segment ids of each chunk id
(:func:`~chunkcache.core.chunk_ids.chunk_id_of`: one chunk id has a segment per text it was
sent with), so :meth:`TieredKVStore.contains_chunk` can tell whether any of them is held.
"""

from __future__ import annotations

from chunkcache.core.chunk_ids import chunk_id_of
from chunkcache.core.kv_store import KVVariant, ReuseCount
from chunkcache.core.store.codec import EntryKey
from chunkcache.core.store.cost import PrefillCostModel
from chunkcache.core.store.policies import EntryStats, EvictionPolicy, PGDSFPolicy
from chunkcache.core.store.tier import Tier

STATS_SLACK = 10_000  # statistics kept beyond the local entries before pruning


class TieredStats:
    """The statistics part of :class:`~chunkcache.core.store.tiered.TieredKVStore`."""

    tiers: list[Tier]
    policies: list[EvictionPolicy]
    cost_model: PrefillCostModel
    stats: dict[EntryKey, EntryStats]
    _tick: int
    _stats_limit: int
    # (fingerprint, chunk id) -> {segment id: how many entries in ``stats`` name it}
    _chunk_segments: dict[tuple[str, str], dict[str, int]]

    def _init_stats(self) -> None:
        """No statistics yet."""
        self.stats = {}
        self._tick = 0
        self._stats_limit = STATS_SLACK
        self._chunk_segments = {}

    def _segments_of_chunk(self, fingerprint: str, chunk_id: str) -> list[str]:
        """Segment ids of ``chunk_id`` that entries the store knows of were stored under."""
        return list(self._chunk_segments.get((fingerprint, chunk_id), ()))

    def _forget_stats(self, key: EntryKey) -> EntryStats | None:
        """Drop the statistics of ``key`` (no tier holds it, or none we track)."""
        stats = self.stats.pop(key, None)
        for policy in self.policies:
            policy.forget(key)
        if stats is not None and stats.names is not None:
            fingerprint, segment_id, _ = stats.names
            chunk = (fingerprint, chunk_id_of(segment_id))
            segments = self._chunk_segments[chunk]
            segments[segment_id] -= 1
            if not segments[segment_id]:
                del segments[segment_id]
                if not segments:
                    del self._chunk_segments[chunk]
        return stats

    def _prune_stats(self) -> None:
        """Forget statistics of entries no local tier holds (Redis and other processes
        evict without telling us); a later load seeds them afresh."""
        local: set[EntryKey] = set()
        for tier in self.tiers:
            entry_keys = getattr(tier, "entry_keys", None)
            if entry_keys is not None and not getattr(tier, "self_evicting", False):
                local.update(entry_keys())
        for key in [k for k in self.stats if k not in local]:
            self._forget_stats(key)
        self._stats_limit = 2 * len(self.stats) + STATS_SLACK

    def _stats_of(self, key: EntryKey) -> EntryStats:
        stats = self.stats.get(key)
        if stats is None:  # stored by another process or an earlier run
            stats = self.stats[key] = EntryStats(0, 0)
            for tier in self.tiers:
                reuse_of = getattr(tier, "reuse_of", None)
                reuse = reuse_of(key) if reuse_of is not None else None
                if reuse is not None:
                    stats.reuse = reuse
                    break
        return stats

    def _touch(
        self, key: EntryKey, fingerprint: str, variant: KVVariant, count: bool
    ) -> EntryStats:
        self._tick += 1
        stats = self._stats_of(key)
        if stats.names is None:  # a key's names never change: index them once
            segments = self._chunk_segments.setdefault(
                (fingerprint, chunk_id_of(variant.segment_id)), {}
            )
            segments[variant.segment_id] = segments.get(variant.segment_id, 0) + 1
        stats.names = (fingerprint, variant.segment_id, variant.context)
        stats.num_bytes, stats.num_tokens = variant.num_bytes, variant.num_tokens
        stats.last_used = self._tick
        stats.frequency += count
        return stats

    def _retouch(self, key: EntryKey) -> None:
        """Let PGDSF recompute the priority of ``key`` in each local tier that holds it
        (Algorithm 1 line 9); the other policies read the statistics when they evict."""
        stats = self._stats_of(key)
        for tier, policy in zip(self.tiers, self.policies, strict=True):
            local = not getattr(tier, "self_evicting", False)
            if isinstance(policy, PGDSFPolicy) and local and key in tier:
                policy.touched(key, stats)

    def _adopt(self, key: EntryKey, variant: KVVariant) -> KVVariant:
        """One live reuse counter per entry: a copy loaded from below shares it."""
        reuse = self._adopted_reuse(key, variant.reuse)
        if reuse is variant.reuse:
            return variant
        return variant.with_tensors(variant.k, variant.v, reuse)

    def _adopted_reuse(self, key: EntryKey, reuse: ReuseCount) -> ReuseCount:
        """The entry's live counter, raised to ``reuse`` (a copy's) if that counted more."""
        stats = self._stats_of(key)
        if stats.reuse is not reuse and stats.reuse.frequency_reuse < reuse.frequency_reuse:
            stats.reuse.num_reuses = reuse.num_reuses
            stats.reuse.frequency_reuse = reuse.frequency_reuse
        return stats.reuse

    def _estimated_cost(self, stats: EntryStats) -> float:
        """Per-token cost of an entry no request measured: from the prefill profile."""
        if len(self.cost_model) == 0 or stats.num_tokens == 0:
            return 1.0
        return self.cost_model.per_token(0, stats.num_tokens)

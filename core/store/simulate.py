"""Replay a request trace through a policy on a simulated tier: hit rates without a model.

Each request is its chunks in prompt order, with token counts.  The store is a real
:class:`TieredKVStore` over one host tier holding placeholder variants whose byte size is
``tokens x bytes_per_token`` (so capacities are in the units the caller picks), driven the way
the engine drives it: look up every variant of each chunk, store a variant for each miss,
record the prefill cost of the misses (PGDSF, RAGCache Formula 4) and each reuse's CFO
(Cache-Craft §3.3).  The hit rate is hit chunks over retrieved chunks, RAGCache §7's
definition.

Cache-Craft's CFO needs each variant's attention metadata; the replay assumes uniform
attention (every context token draws the same share, CCI 1), so CFO = 1 - beta' from how much
of the variant's old context, and in which order, the request keeps (Eq. 6-8, 12).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from chunkcache.core.craft import CraftMeta, fix_overhead
from chunkcache.core.kv_store import ROOT_CONTEXT, KVVariant, extend_context
from chunkcache.core.store.tier import MemoryTier
from chunkcache.core.store.tiered import TieredKVStore

Request = Sequence[tuple[str, int]]  # (chunk_id, num_tokens), in prompt order
FINGERPRINT = "simulated-model"


@dataclass(frozen=True)
class ReplayResult:
    """One eviction policy's counts over a replayed request trace."""

    policy: str
    capacity_bytes: int
    lookups: int
    hits: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        """Hits per lookup (0 when nothing was looked up)."""
        return self.hits / self.lookups if self.lookups else 0.0


def linear_prefill_cost(cached: int, new: int) -> float:
    """A default T(cached, new) in seconds: linear in new tokens, attention to cached ones
    growing it (shaped like measured prefill on small models; pass real measurements)."""
    return new * 1e-4 * (1.0 + (cached + new / 2) / 4096)


def replay(
    requests: Iterable[Request],
    policy: str,
    capacity_bytes: int,
    bytes_per_token: int = 2,
    prefill_cost: Callable[[int, int], float] = linear_prefill_cost,
) -> ReplayResult:
    """Run ``requests`` through ``policy`` with ``capacity_bytes`` of cache."""
    if bytes_per_token < 2 or bytes_per_token % 2:
        raise ValueError("bytes_per_token must be even and at least 2 (k and v)")
    store = TieredKVStore([MemoryTier("host", capacity_bytes)], policy=policy)
    lookups = hits = 0
    for request in requests:
        context, cached_tokens, new_tokens = ROOT_CONTEXT, 0, 0
        before_ids: list[str] = []
        before_tokens: list[int] = []
        computed: list[tuple[str, str]] = []
        for chunk_id, num_tokens in request:
            lookups += 1
            variants = store.variants(FINGERPRINT, chunk_id)
            if variants:
                hits += 1
                cached_tokens += num_tokens
                cfos = [fix_overhead(v.meta, before_ids, before_tokens, 1.0) for v in variants]
                best = min(range(len(cfos)), key=cfos.__getitem__)
                variants[best].reuse.record(cfos[best])
            else:
                new_tokens += num_tokens
                meta = _uniform_meta(num_tokens, before_ids, before_tokens)
                store.put(
                    FINGERPRINT, _placeholder(chunk_id, context, num_tokens, meta, bytes_per_token)
                )
                computed.append((chunk_id, context))
            before_ids.append(chunk_id)
            before_tokens.append(num_tokens)
            context = extend_context(context, chunk_id)
        if computed:
            seconds = prefill_cost(cached_tokens, new_tokens)
            store.record_prefill(FINGERPRINT, computed, cached_tokens, new_tokens, seconds)
    evictions = int(store.metrics()["tiers"]["host"]["evictions"])
    return ReplayResult(policy, capacity_bytes, lookups, hits, evictions)


def _uniform_meta(num_tokens: int, ids: list[str], tokens: list[int]) -> CraftMeta:
    total = sum(tokens)
    inter = tuple(t / total for t in tokens) if total else ()
    return CraftMeta(1.0, (0.0,) * num_tokens, tuple(ids), inter, tuple(tokens))


def _placeholder(
    chunk_id: str, context: str, num_tokens: int, meta: CraftMeta, bytes_per_token: int
) -> KVVariant:
    # k, v: [1, 1, n, bytes_per_token / 2] of uint8: only their size matters here
    k = torch.zeros((1, 1, num_tokens, bytes_per_token // 2), dtype=torch.uint8)
    return KVVariant(chunk_id, context, 0, False, k, k, meta)

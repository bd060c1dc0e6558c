"""What the engine calls on its store beyond :class:`KVStore` (no-ops for other stores).

The engine (core/engine.py, owned elsewhere) wires these in three places::

    with track_store(self.store) as usage:              # around the whole of prefill()
        ...                                             # plan, place, compute, store
    stats.extra["store"] = usage.as_dict()              # per-request tier counts
    record_prefill(self.store, fingerprint, fresh, cached, new, seconds)  # PGDSF cost

and a server with a queue calls :func:`prefetch` when a request is queued.  For layer-wise
loading (Cache-Craft §3.4.2, Algorithm 2) :func:`preload_depth` gives how many layers to
load ahead and :func:`load_profile` the controller's inputs; the loop itself is
:mod:`chunkcache.core.chunk_placing`, which reads each layer of a disk hit (a
:class:`~chunkcache.core.store.lazy.LazyKVVariant`) as it places it, behind compute.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager

from chunkcache.core.kv_store import KVStore
from chunkcache.core.store.metrics import StoreUsage
from chunkcache.core.store.tiered import TieredKVStore


@contextmanager
def track_store(store: KVStore) -> Iterator[StoreUsage]:
    """This request's store counts; empty for a store without tiers."""
    if isinstance(store, TieredKVStore):
        with store.track() as usage:
            yield usage
    else:
        yield StoreUsage([])


def record_prefill(
    store: KVStore,
    fingerprint: str,
    computed: Sequence[tuple[str, str]],
    cached_tokens: int,
    new_tokens: int,
    seconds: float,
) -> None:
    """Feed PGDSF's cost estimate (RAGCache Formula 4): a prefill that computed the
    ``(segment_id, context)`` variants in ``computed`` took ``seconds`` for ``new_tokens``
    (computed plus recomputed) after ``cached_tokens`` reused ones."""
    if isinstance(store, TieredKVStore):
        store.record_prefill(fingerprint, computed, cached_tokens, new_tokens, seconds)


def prefetch(store: KVStore, fingerprint: str, segment_ids: Sequence[str]) -> Future[int] | None:
    """Start moving a queued request's chunks up to the fastest tier (RAG-DCache §III)."""
    if isinstance(store, TieredKVStore):
        return store.prefetch(fingerprint, segment_ids)
    return None


def preload_depth(num_layers: int, prefill_s: float, load_s: float) -> int:
    """Cache-Craft Eq. 16: L_p = (L - 1)(1 - T_prefill / T_load) + 1 layers to load before
    the first layer runs, so the rest loads while layers compute; 1 when loading is faster
    than prefill, every layer when prefill takes no time."""
    if num_layers < 1:
        raise ValueError("num_layers must be positive")
    if load_s <= 0 or prefill_s >= load_s:
        return 1
    depth = (num_layers - 1) * (1 - prefill_s / load_s) + 1
    return min(num_layers, max(1, math.ceil(depth)))


def load_profile(store: KVStore, usage: StoreUsage, cached: int, new: int) -> tuple[float, float]:
    """This request's seconds spent reading lower tiers so far, and the store's estimate
    of one prefill token's seconds over all layers (0 without a profile or tiers)."""
    if not isinstance(store, TieredKVStore):
        return 0.0, 0.0
    load_s = sum(counts.get("load_seconds", 0.0) for counts in usage.tiers.values())
    return load_s, store.cost_model.per_token(cached, new)

"""Helpers for the tiered-store tests: tiny synthetic variants, compared and measured.

(Named ``test_store_*`` to sit with the store tests; it holds no tests itself.)
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from chunkcache.core.cache import ChunkCache
from chunkcache.core.kv_store import ROOT_CONTEXT, KVStore, KVVariant

FP = "tiny-model-fingerprint"


def make_variant(
    segment_id: str,
    context: str = ROOT_CONTEXT,
    num_tokens: int = 4,
    seed: int = 0,
    exact: bool = True,
    start: int = 0,
) -> KVVariant:
    """A variant of 2 layers x 1 KV head x ``num_tokens`` x 4 dims of float32 (32 B a token
    for k and v together), filled from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 1, num_tokens, 4, generator=gen)
    v = torch.randn(2, 1, num_tokens, 4, generator=gen)
    return KVVariant(segment_id, context, start, exact, k, v)


def same_kv(a: KVVariant | None, b: KVVariant) -> bool:
    return a is not None and torch.equal(a.k.cpu(), b.k) and torch.equal(a.v.cpu(), b.v)


def tree_bytes(root: Path) -> int:
    """Bytes of every committed entry file under a disk tier's root."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name[0] != ".")


def cache_on(store: KVStore) -> ChunkCache:
    """A ChunkCache whose backend is just enough of a LocalBackend for it to find ``store``
    (``backend.engine.store``): its prefix tree follows the store's evictions."""
    backend = SimpleNamespace(engine=SimpleNamespace(store=store))
    return ChunkCache(backend=backend)


def promoted(cache: ChunkCache, chunk_ids: list[str]) -> int:
    """Request ``chunk_ids`` until the prefix tree promotes them (CRAFT's threshold is 2
    accesses); the length of their prefix the tree then holds."""
    for _ in range(2):
        cache.arrange(chunk_ids, ordering="retriever")
    return cache.prefix_tree.longest_prefix_length(chunk_ids)

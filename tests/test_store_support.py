"""Helpers for the tiered-store tests: tiny synthetic variants, compared and measured.

(Named ``test_store_*`` to sit with the store tests; it holds no tests itself.)
"""

from __future__ import annotations

from pathlib import Path

import torch

from chunkcache.core.kv_store import ROOT_CONTEXT, KVVariant

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

"""Precompute chunk KV offline (RAG-DCache §III, step 1: offline cache preparation).

:func:`warm` runs each chunk through the engine once, after an optional prefix (the system
prompt the app will use: chunks computed after it are reused better than chunks computed at
position 0), and lets the store keep the chunk's variant; with the settings' default
write-through it lands in the disk tier.  It is resumable: a chunk with any stored variant
is skipped, so an interrupted run picks up where it stopped.

Chunks come as :class:`~chunkcache.core.corpus.CorpusChunk` lists: the bundled corpus
(:func:`chunkcache.core.corpus.load_corpus`), or a user's folder or Chroma collection
(:mod:`chunkcache.core.user_corpus`, the chunks ``chunkcache bench rag`` retrieves from them).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chunkcache.core.engine import ChunkEngine
from chunkcache.core.errors import UsageError
from chunkcache.core.generation import Policy
from chunkcache.core.segmenter import ChunkSegment, Segment, TextSegment
from chunkcache.core.store.tier import MemoryTier
from chunkcache.core.store.tiered import TieredKVStore
from chunkcache.core.tokenization import SegmentTokenizer

if TYPE_CHECKING:
    from chunkcache.core.corpus import CorpusChunk


def check_keeps_writes(store: TieredKVStore) -> None:
    """:class:`UsageError` unless a tier that outlives the process can keep what warm
    computes: a disk tier opened read-only (a read-only mount) keeps nothing."""
    lasting = [tier for tier in store.tiers if not isinstance(tier, MemoryTier)]
    if lasting and all(getattr(tier, "read_only", False) for tier in lasting):
        raise UsageError(
            "warm has nowhere to keep what it computes: the store's disk tier is read-only "
            f"({', '.join(str(getattr(tier, 'root', tier.name)) for tier in lasting)})"
        )


@dataclass(frozen=True)
class WarmReport:
    """What one :func:`warm` run did."""

    computed: int
    skipped: int
    seconds: float


def warm(
    engine: ChunkEngine,
    chunks: Sequence[CorpusChunk],
    prefix: str = "",
    policy: Policy = "full",
    progress: bool = True,
) -> WarmReport:
    """Compute and store the KV of every chunk not stored yet.

    ``policy`` ``cachecraft`` also measures each chunk's Cache-Craft metadata (CCI and
    per-token context attention) for the ``cachecraft`` serving policy.
    """
    store = engine.store
    if not isinstance(store, TieredKVStore):
        raise TypeError("warm needs the engine to run on a TieredKVStore")
    if engine.lm.tokenizer is None:
        raise ValueError("warm needs a model loaded with its tokenizer")
    check_keeps_writes(store)
    tokenize = SegmentTokenizer(engine.lm.tokenizer)
    fingerprint = engine.lm.fingerprint
    started = time.perf_counter()
    computed = skipped = 0
    bar = _progress(len(chunks), progress)
    for chunk in chunks:
        segments: list[Segment] = [TextSegment(prefix)] if prefix else []
        segments.append(ChunkSegment(chunk.chunk_id, chunk.text))
        tokens = tokenize(segments)
        if store.contains_segment(fingerprint, tokens[-1].segment_id):  # the chunk's key
            skipped += 1
        else:
            engine.prefill(tokens, policy)
            computed += 1
        bar.update(1)
        bar.set_postfix(computed=computed, skipped=skipped)
    bar.close()
    store.flush()
    return WarmReport(computed, skipped, time.perf_counter() - started)


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="chunk", desc="warm", disable=not enabled)

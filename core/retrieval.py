"""Framework-neutral retriever step: ids, collapse, dedupe, order, register.

Both framework wrappers turn their documents/nodes into ``(text, metadata)``
pairs, call :func:`plan_retrieval`, and build their results from the plan.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chunkcache.core.cache import ChunkCache
from chunkcache.core.chunk_ids import chunk_id_for
from chunkcache.core.ledger import DedupeMode
from chunkcache.core.ordering import Ordering

logger = logging.getLogger(__name__)

CONVERSATION_CONFIG_KEYS = ("conversation_id", "session_id", "thread_id")


@dataclass(frozen=True)
class PlannedChunk:
    """One document to return: where it came from and what it is."""

    source_index: int
    chunk_id: str
    retriever_rank: int
    seen_in_conversation: bool


@dataclass(frozen=True)
class RetrievalPlan:
    """The documents to return, in prompt order, and what was left out and why."""

    chunks: list[PlannedChunk]
    dropped_chunk_ids: list[str]
    num_collapsed: int
    num_empty: int
    prefix_length: int


def conversation_id_from(configurable: Mapping[str, Any] | None) -> str | None:
    """The first of ``conversation_id``, ``session_id``, ``thread_id`` that is set."""
    for key in CONVERSATION_CONFIG_KEYS:
        value = (configurable or {}).get(key)
        if value is not None:
            return str(value)
    return None


def plan_retrieval(
    documents: Sequence[tuple[str, Mapping[str, Any] | None]],
    cache: ChunkCache,
    *,
    conversation_id: str | None,
    ordering: Ordering,
    dedupe: DedupeMode,
) -> RetrievalPlan:
    """Plan what a wrapped retriever returns for ``documents`` (text, metadata) in rank order.

    Empty or whitespace-only documents carry nothing for a prompt and are left
    out (logged).  Documents sharing a chunk id collapse to the best-ranked one.
    """
    first_index: dict[str, int] = {}
    num_empty = 0
    for index, (text, metadata) in enumerate(documents):
        if not isinstance(text, str):
            raise TypeError(f"document {index} text must be str, got {type(text).__name__}")
        if not text.strip():
            num_empty += 1
            continue
        cid = chunk_id_for(text, metadata, cache.namespace)
        if cid not in first_index:
            first_index[cid] = index
            if not cache.registry.register(cid, text):
                logger.warning("chunk %s (%d chars) is too large to register", cid, len(text))
    if num_empty:
        logger.warning("left out %d empty or whitespace-only documents", num_empty)
    arrangement = cache.arrange(
        list(first_index), conversation_id=conversation_id, ordering=ordering, dedupe=dedupe
    )
    rank = {cid: r for r, cid in enumerate(first_index)}
    chunks = [
        PlannedChunk(
            source_index=first_index[cid],
            chunk_id=cid,
            retriever_rank=rank[cid],
            seen_in_conversation=cid in arrangement.seen,
        )
        for cid in arrangement.order
    ]
    num_collapsed = len(documents) - num_empty - len(first_index)
    return RetrievalPlan(
        chunks=chunks,
        dropped_chunk_ids=arrangement.dropped,
        num_collapsed=num_collapsed,
        num_empty=num_empty,
        prefix_length=arrangement.prefix_length,
    )

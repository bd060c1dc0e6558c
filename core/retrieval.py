"""Framework-neutral retriever step: ids, collapse, dedupe, order, register.

Both framework wrappers call their base retriever inside :func:`retrieval_scope`,
turn its documents/nodes into ``(text, metadata)`` pairs, call :func:`plan_retrieval`,
and build their results from the plan.

One request is planned once per cache.  When wrappers on one cache are chained (a
library wraps a retriever the app already wrapped, or a wrapped retriever sits inside
another retriever that is wrapped again), the outermost plans: it counts the request
in the access table, dedupes it against the conversation and orders it.  Every wrapper
nested inside it returns its base's results untouched (:func:`plan_retrieval` returns
None for it), so a request is neither counted twice nor dropped as "already sent" by
the wrapper that sent it.  The outermost wrapper's ordering and dedupe mode apply, and
its conversation id, or when it has none the first one a nested wrapper was given.

A chat helper that trims its history may run the retriever again for the same turn
(chunks it dropped as repeats left the prompt): inside :func:`replanning` that request
is deduped and ordered as usual but not counted again in the access table.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from chunkcache.core.cache import ChunkCache
from chunkcache.core.chunk_ids import chunk_id_for
from chunkcache.core.ledger import DedupeMode, check_conversation_id
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


class RetrievalScope:
    """A wrapper's call to its base retriever, on ``cache``, for ``conversation_id``.

    ``open`` until the call returns: a thread or task started inside it inherits the
    scope but, once the call has returned, plans its own requests again.
    """

    def __init__(self, cache: ChunkCache, conversation_id: str | None) -> None:
        self.cache = cache
        self.conversation_id = conversation_id
        self.open = True


# The scopes open in this thread or task, outermost first.
_open_scopes: ContextVar[tuple[RetrievalScope, ...]] = ContextVar(
    "chunkcache_retrieval_scopes", default=()
)


@contextmanager
def retrieval_scope(cache: ChunkCache, conversation_id: str | None) -> Iterator[RetrievalScope]:
    """Open while a wrapper calls its base retriever: wrappers on ``cache`` reached from
    inside leave the planning to this one.  After it closes, ``scope.conversation_id``
    is the conversation to plan for (the wrapper's, else a nested wrapper's).

    An unusable ``conversation_id`` raises :class:`InvalidConversationIdError` here,
    before the base retriever runs."""
    scope = RetrievalScope(cache, _checked(conversation_id))
    token = _open_scopes.set((*_open_scopes.get(), scope))
    try:
        yield scope
    finally:
        scope.open = False
        _open_scopes.reset(token)


# True while the retrievals planned in this thread or task re-run a request already counted.
_replanning: ContextVar[bool] = ContextVar("chunkcache_replanning", default=False)


@contextmanager
def replanning() -> Iterator[None]:
    """Retrievals planned inside re-run a request already planned (on any cache): they are
    deduped and ordered as usual, but the access table does not count the request again."""
    token = _replanning.set(True)
    try:
        yield
    finally:
        _replanning.reset(token)


def _checked(conversation_id: str | None) -> str | None:
    """``conversation_id`` as the ledger keys it, or None for no conversation."""
    return None if conversation_id is None else check_conversation_id(conversation_id)


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
) -> RetrievalPlan | None:
    """Plan what a wrapped retriever returns for ``documents`` (text, metadata) in rank order.

    Empty or whitespace-only documents carry nothing for a prompt and are left
    out (logged).  Documents sharing a chunk id collapse to the best-ranked one.

    None, and nothing recorded, inside a :func:`retrieval_scope` on ``cache``: the
    wrapper that opened it plans the request, so the caller returns ``documents``
    as they are (see the module docstring).
    """
    conversation_id = _checked(conversation_id)
    outer = next((s for s in _open_scopes.get() if s.cache is cache and s.open), None)
    if outer is not None:
        if outer.conversation_id is None:
            outer.conversation_id = conversation_id
        return None
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
        list(first_index),
        conversation_id=conversation_id,
        ordering=ordering,
        dedupe=dedupe,
        count_request=not _replanning.get(),
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

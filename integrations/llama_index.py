"""LlamaIndex drop-ins: :class:`ChunkCacheRetriever` and :class:`ChunkCachePostprocessor`.

Both give every node a stable ``chunk_id`` and return the nodes in an order that
lines shared chunks up as prompt prefixes, minus (or marked with) the chunks this
conversation already has.  The chat engine that lays a conversation out for
reuse is :class:`chunkcache.integrations.llama_index_chat.ChunkCacheChatEngine`.

>>> from chunkcache.integrations.llama_index import ChunkCacheRetriever
>>> retriever = ChunkCacheRetriever(index.as_retriever(similarity_top_k=5))  # doctest: +SKIP
>>> nodes = retriever.for_conversation("user-42").retrieve("How do I parse JSON?")  # doctest: +SKIP
>>> nodes[0].node.metadata["chunk_id"]  # doctest: +SKIP
'3f0c...'

Each returned node is a copy; its metadata gains ``chunk_id`` (the id of the node's
text without the whitespace around it, which LlamaIndex strips when it puts a node in a
prompt), ``retriever_rank`` (rank among the distinct chunks the base retriever
returned) and, with ``dedupe="mark"``, ``seen_in_conversation``.  These keys are added
to the node's ``excluded_llm_metadata_keys`` and ``excluded_embed_metadata_keys``: they
change from request to request, and text that changes next to a chunk costs its reuse.
The node keeps its own ``id_`` (LlamaIndex always assigns one, and docstores and
relationships refer to it); the chunk id lives in the metadata only.

A node with no text but other content for the prompt is returned too, after the
chunks, as it came: metadata LlamaIndex renders into the prompt (``MetadataMode.LLM``:
a title, a table's caption), or media (an ``ImageNode``'s image, a ``Node``'s image,
audio or video, which LlamaIndex's multimodal synthesizers send).  It has no chunk
text, so it gets no chunk id, is not cached or deduped, and is sent in every prompt
that includes it.  A node with none of these is left out.

When is ``dedupe="drop"`` safe?  Dropping a chunk the conversation has already
seen (CRAFT §4.3) loses nothing only while that chunk is still in the prompt,
i.e. while every earlier turn's chunks stay in the chat history.  That holds for
``ChunkCacheChatEngine``, which keeps each turn's chunks in that turn's user
message and resets the ledger to the chunks in its history before every turn.  It
does not hold for engines that put the context in a per-turn system message
(``ContextChatEngine``) or that trim memory on their own: use ``"mark"`` (the
default) there, or call ``cache.ledger.forget(conversation_id)`` whenever the
history loses chunks.

LlamaIndex's own engines, as apps build them:

- ``index.as_chat_engine(chat_mode=...)`` builds its own retriever, so a
  :class:`ChunkCachePostprocessor` brings the planning in; bind the LLM to the same
  conversation, so the engine keeps each turn for the next to extend::

      engine = index.as_chat_engine(
          chat_mode="condense_plus_context",
          llm=llm.for_conversation("user-42"),
          node_postprocessors=[ChunkCachePostprocessor(conversation_id="user-42")],
      )

  (``ContextChatEngine.from_defaults(retriever=ChunkCacheRetriever(...), llm=...)`` does
  the same.)  ``"context"`` and ``"condense_plus_context"`` put the context in the system
  message: a turn reuses the history only while its chunks and their order stay those of
  the turn before; ``condense_plus_context`` also rewrites the question, a completion the
  engine keeps apart from the turns.  ``"condense_question"``'s prompts hold no history:
  only the chunks are reused.  ``ChunkCacheChatEngine`` keeps every turn a prefix of the
  next, whatever is retrieved.
- ``CitationQueryEngine`` splits each node into "Source N:" nodes of at most
  ``citation_chunk_size`` tokens (512 by default, half LlamaIndex's default chunk size):
  a node that fits one source is found as a chunk inside it; one split into several is
  sent as plain text (no warning; its pieces are not cached as chunks), each piece keeping
  the whole node's ``chunk_id`` in its metadata.  Set ``citation_chunk_size`` to at least
  the index's chunk size.
- A postprocessor that replaces a node's text (``MetadataReplacementPostProcessor`` with a
  sentence window) goes before a :class:`ChunkCachePostprocessor`, which then plans the
  new text as the chunk, under the new text's own id.  Without one after it, the chunk is
  the retrieved text, found only where it stands verbatim in the new text, and the node's
  ``chunk_id`` names the retrieved text.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field
from llama_index.core.callbacks import CallbackManager
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import (
    BaseNode,
    ImageNode,
    MetadataMode,
    Node,
    NodeWithScore,
    QueryBundle,
)
from llama_index.core.settings import Settings

from chunkcache.core.cache import ChunkCache, default_cache
from chunkcache.core.chunk_ids import CHUNK_ID_METADATA_KEY, chunk_id_for
from chunkcache.core.ledger import DedupeMode, check_conversation_id, check_dedupe_mode
from chunkcache.core.ordering import Ordering, check_ordering
from chunkcache.core.retrieval import plan_retrieval, retrieval_scope
from chunkcache.integrations.llama_index_fields import (
    CacheField,
    ConversationIdField,
    optional_conversation_id,
)
from chunkcache.integrations.llama_index_llm import ChunkCacheLLM, node_text

__all__ = ["ChunkCacheLLM", "ChunkCachePostprocessor", "ChunkCacheRetriever", "plan_nodes"]

# The node copies plan_nodes returned, per cache (both held weakly): a postprocessor on
# that cache passes them through, since the request they came in is planned already.
_planned: weakref.WeakKeyDictionary[ChunkCache, weakref.WeakValueDictionary[int, BaseNode]] = (
    weakref.WeakKeyDictionary()
)
_planned_lock = threading.Lock()
# The metadata keys plan_nodes adds: they describe the text the node had then.
_PLAN_KEYS = frozenset({CHUNK_ID_METADATA_KEY, "retriever_rank", "seen_in_conversation"})


def plan_nodes(
    nodes: Sequence[NodeWithScore],
    cache: ChunkCache,
    *,
    conversation_id: str | None,
    ordering: Ordering,
    dedupe: DedupeMode,
) -> list[NodeWithScore]:
    """Copies of ``nodes`` (in retriever rank order) as :func:`plan_retrieval` arranges them.

    Ids are computed on the node's bare content without the whitespace around it
    (:func:`~chunkcache.integrations.llama_index_llm.node_text`), the text the LLM side
    looks for in prompts.  Nodes sharing a chunk id collapse to the
    best-ranked one; scores are kept.  Nodes with no text but LLM metadata or media
    follow the chunks, unplanned (see the module docs); empty nodes are left out.  Called while a
    wrapper on ``cache`` retrieves (nested in it), it returns ``nodes`` as they are:
    that wrapper plans the request.
    """
    unplanned = [_is_textless_content(n.node) for n in nodes]
    chunks = [n for n, other in zip(nodes, unplanned, strict=True) if not other]
    plan = plan_retrieval(
        [(node_text(n.node), n.node.metadata) for n in chunks],
        cache,
        conversation_id=conversation_id,
        ordering=ordering,
        dedupe=dedupe,
    )
    if plan is None:  # an outer wrapper on this cache plans the request
        return list(nodes)
    planned = []
    for chunk in plan.chunks:
        source = chunks[chunk.source_index]
        added: dict[str, Any] = {
            "chunk_id": chunk.chunk_id,
            "retriever_rank": chunk.retriever_rank,
        }
        if dedupe == "mark":
            added["seen_in_conversation"] = chunk.seen_in_conversation
        node = source.node.model_copy(
            update={
                "metadata": {**(source.node.metadata or {}), **added},
                "excluded_llm_metadata_keys": _union(source.node.excluded_llm_metadata_keys, added),
                "excluded_embed_metadata_keys": _union(
                    source.node.excluded_embed_metadata_keys, added
                ),
            }
        )
        planned.append(NodeWithScore(node=node, score=source.score))
    with _planned_lock:
        mine = _planned.setdefault(cache, weakref.WeakValueDictionary())
        mine.update((id(n.node), n.node) for n in planned)
    others = [n for n, other in zip(nodes, unplanned, strict=True) if other]
    return planned + [NodeWithScore(node=n.node.model_copy(), score=n.score) for n in others]


def _is_textless_content(node: BaseNode) -> bool:
    """Whether ``node`` has no text but metadata LlamaIndex puts in a prompt with it, or
    media."""
    if node_text(node):
        return False
    return _has_media(node) or bool(node.get_content(metadata_mode=MetadataMode.LLM).strip())


def _has_media(node: BaseNode) -> bool:
    """Whether ``node`` holds an image, audio or video (read without loading it)."""
    if isinstance(node, ImageNode):
        return any((node.image, node.image_path, node.image_url))
    if isinstance(node, Node):
        return any((node.image_resource, node.audio_resource, node.video_resource))
    return False


def _is_planned_copy(node: BaseNode, cache: ChunkCache) -> bool:
    """Whether ``node`` is a copy :func:`plan_nodes` returned for ``cache``."""
    with _planned_lock:
        mine = _planned.get(cache)
        return mine is not None and mine.get(id(node)) is node


def _was_planned(node: BaseNode, cache: ChunkCache) -> bool:
    """Whether ``node`` is a copy :func:`plan_nodes` returned for ``cache``, its text
    still the one it was planned with (a postprocessor may have replaced it)."""
    return _is_planned_copy(node, cache) and (
        node.metadata.get(CHUNK_ID_METADATA_KEY) == _chunk_id(node, cache)
    )


def _unplanned(node: NodeWithScore, cache: ChunkCache) -> NodeWithScore:
    """``node``, or if it is a planned copy whose text was replaced since (a
    ``MetadataReplacementPostProcessor`` ran), a copy without the keys :func:`plan_nodes`
    added for its old text: its new text gets its own id, whichever node it replaced."""
    if not _is_planned_copy(node.node, cache):
        return node
    metadata = {k: v for k, v in node.node.metadata.items() if k not in _PLAN_KEYS}
    return NodeWithScore(node=node.node.model_copy(update={"metadata": metadata}), score=node.score)


def _chunk_id(node: BaseNode, cache: ChunkCache) -> str:
    """The id :func:`plan_nodes` gives ``node`` on ``cache``."""
    return chunk_id_for(node_text(node), node.metadata, cache.namespace)


def _repeats(node: BaseNode, chunk_ids: dict[str, Any], cache: ChunkCache) -> bool:
    """Whether ``node``'s text is one of ``chunk_ids`` (a node without text is no chunk)."""
    return bool(node_text(node)) and _chunk_id(node, cache) in chunk_ids


def _callback_manager_of(retriever: BaseRetriever) -> CallbackManager:
    """The callback manager ``retriever`` traces with (LlamaIndex gives one without any
    ``Settings.callback_manager`` on first use).

    A wrapper shares it, as LlamaIndex's components share ``Settings.callback_manager``: a
    manager clears its trace map only when a trace starts on it at the top, so one that
    always runs nested under another's trace (the base's under the wrapper's, or a
    wrapper's own under a query engine's) keeps every request's event ids for good.
    """
    manager = getattr(retriever, "callback_manager", None)
    return manager if isinstance(manager, CallbackManager) else Settings.callback_manager


def _union(keys: list[str], added: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys([*keys, *added]))


class ChunkCacheRetriever(BaseRetriever):
    """Wraps a LlamaIndex retriever: stable chunk ids, cache-friendly order, dedupe.

    Args:
        base_retriever: the retriever whose nodes are returned.
        cache: shared chunk state; the process-wide default when omitted, so an
            LLM wrapper created without ``cache=`` sees the same chunks.
        ordering: ``"tree"`` (default), ``"frequency"`` (CRAFT §4.2) or ``"retriever"``.
        dedupe: ``"mark"`` (default), ``"drop"`` (see the module docs for when
            it is safe) or ``"off"``.
        conversation_id: the conversation to dedupe against; LlamaIndex passes
            no session to retrievers, so bind one here or with
            :meth:`for_conversation`.  Without one nothing is deduped.
        callback_manager: LlamaIndex callbacks; by default the base retriever's, so a
            request is one trace.  Pass one only if the base retriever and the query
            engine use it too: a LlamaIndex manager that always runs nested under
            another one's trace keeps two trace-map entries per request, for good.

    Wrapping a retriever that already is (or contains) a wrapper on the same cache is
    safe: the outermost wrapper plans each request once (with its own conversation id,
    else the inner one's), the inner ones pass their base's nodes through (see
    :mod:`chunkcache.core.retrieval`).  So wrap a ``QueryFusionRetriever`` itself (its
    sub-retrievers may be wrapped too: they pass their nodes through, fused as unwrapped).
    It merges its sub-retrievers' nodes by hash, which covers the metadata a wrapper adds:
    under wrapped sub-retrievers alone, a chunk two of them returned is fused as two nodes,
    so it is not ranked up and its copies take two of the fusion's ``similarity_top_k``
    places (fewer chunks come back).  LlamaIndex returns it once when the copies are one
    node, twice when they come from two indexes of one corpus (a
    :class:`ChunkCachePostprocessor` then sends it once).  Likewise wrap a retriever that
    puts other nodes in place of its base's (``AutoMergingRetriever``'s merged parents,
    ``RecursiveRetriever``'s referenced nodes): a wrapper inside it names the nodes it
    replaces, and the nodes it puts in come back without a ``chunk_id``.

    >>> retriever = ChunkCacheRetriever(base, ordering="frequency")  # doctest: +SKIP
    >>> retriever.for_conversation("user-42").retrieve("What is json.dumps?")  # doctest: +SKIP
    """

    def __init__(
        self,
        base_retriever: BaseRetriever,
        *,
        cache: ChunkCache | None = None,
        ordering: Ordering = "tree",
        dedupe: DedupeMode = "mark",
        conversation_id: str | None = None,
        callback_manager: CallbackManager | None = None,
    ) -> None:
        if callback_manager is None:
            callback_manager = _callback_manager_of(base_retriever)
        super().__init__(callback_manager=callback_manager)
        self._base_retriever = base_retriever
        self._cache = cache if cache is not None else default_cache()
        self._ordering = check_ordering(ordering)
        self._dedupe = check_dedupe_mode(dedupe)
        self._conversation_id = optional_conversation_id(conversation_id)

    @property
    def base_retriever(self) -> BaseRetriever:
        return self._base_retriever

    @property
    def cache(self) -> ChunkCache:
        return self._cache

    @property
    def ordering(self) -> Ordering:
        return self._ordering

    @property
    def dedupe(self) -> DedupeMode:
        return self._dedupe

    @property
    def conversation_id(self) -> str | None:
        return self._conversation_id

    def for_conversation(self, conversation_id: str) -> ChunkCacheRetriever:
        """A copy bound to ``conversation_id``, sharing this retriever's base and cache."""
        bound = copy.copy(self)
        bound._conversation_id = check_conversation_id(conversation_id)
        return bound

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        with retrieval_scope(self._cache, self._conversation_id) as scope:
            nodes = self._base_retriever.retrieve(query_bundle)
        return self._plan(nodes, scope.conversation_id)

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        with retrieval_scope(self._cache, self._conversation_id) as scope:
            nodes = await self._base_retriever.aretrieve(query_bundle)
        return self._plan(nodes, scope.conversation_id)

    def _plan(self, nodes: list[NodeWithScore], conversation_id: str | None) -> list[NodeWithScore]:
        return plan_nodes(
            nodes,
            self._cache,
            conversation_id=conversation_id,
            ordering=self._ordering,
            dedupe=self._dedupe,
        )


class ChunkCachePostprocessor(BaseNodePostprocessor):
    """The retriever's arrangement for nodes from any retriever or query engine.

    >>> engine = index.as_query_engine(  # doctest: +SKIP
    ...     node_postprocessors=[ChunkCachePostprocessor(conversation_id="user-42")]
    ... )

    Place it last, so the nodes it orders are the ones the prompt gets.

    Behind a :class:`ChunkCacheRetriever` on the same cache (in one query engine), the
    retriever has planned the request: the nodes it returned pass through as they come
    (a chunk two such retrievers returned, once), so the request is neither counted
    twice nor dropped as "already sent".  Nodes added
    since (e.g. by ``PrevNextNodePostprocessor``) are planned as a request of their own
    and follow them, less those repeating a chunk already among them.
    """

    cache: CacheField = Field(default_factory=default_cache, exclude=True)
    ordering: Ordering = "tree"
    dedupe: DedupeMode = "mark"
    conversation_id: ConversationIdField = None

    @classmethod
    def class_name(cls) -> str:
        return "ChunkCachePostprocessor"

    def for_conversation(self, conversation_id: str) -> ChunkCachePostprocessor:
        """A copy bound to ``conversation_id``, sharing this postprocessor's cache."""
        return self.model_copy(update={"conversation_id": check_conversation_id(conversation_id)})

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        planned: dict[str, NodeWithScore] = {}
        others: list[NodeWithScore] = []
        for n in nodes:
            if _was_planned(n.node, self.cache):
                # Two wrapped retrievers' copies of a chunk (under a QueryFusionRetriever,
                # which merges by hash, metadata included) go into the prompt once.
                planned.setdefault(n.node.metadata[CHUNK_ID_METADATA_KEY], n)
            else:
                others.append(_unplanned(n, self.cache))
        if planned:  # behind a ChunkCacheRetriever on this cache: only the others are new
            others = [n for n in others if not _repeats(n.node, planned, self.cache)]
            if not others:
                return list(planned.values())
        return list(planned.values()) + plan_nodes(
            others,
            self.cache,
            conversation_id=self.conversation_id,
            ordering=self.ordering,
            dedupe=self.dedupe,
        )

"""``ChunkCache``: the state both sides of a RAG app share.

It holds the access table, the chunk-prefix tree, the conversation ledger, the
chunk registry (with a matcher over it) and the generation backend.  Retriever
wrappers call :meth:`ChunkCache.arrange` once per request; LLM wrappers find the
registered chunks in their prompts and send them to :attr:`ChunkCache.backend`.
Wrappers created without ``cache=`` share :func:`default_cache`, so a retriever
and an LLM cooperate unwired.

When the backend's engine store drops a chunk's last cached variant, the prefix
tree forgets every prefix through that chunk, so the tree only promises prefixes
whose KV can still be there (RAGCache §5.1 keeps its knowledge tree in step the
same way).  A chunk id has one store key per text sent under it
(:func:`~chunkcache.core.chunk_ids.chunk_key`): its prefixes stay while the store
holds any of them.

Only a store in this process tells of its drops.  Evictions nobody is told of leave their
prefixes in the tree: a shared Redis tier evicts server-side (its LRU, on any client's write,
or ``maxmemory``) without a word to the clients, ``chunkcache serve``'s store is in the
server's process (the ``http`` backend), and vLLM's prefix cache is vLLM's.  The tree then
favours a prefix that may no longer be cached.  That costs little: the request laid out in
that order recomputes the prefix and caches it again, so the tree's promise holds from the
next request on; what is lost is another path, still cached, it could have followed.
Stale nodes otherwise go with the tree's least recently used bound.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from chunkcache.core.access_table import DEFAULT_WINDOW, AccessTable
from chunkcache.core.backends import BackendName, BackendSpec
from chunkcache.core.chunk_ids import chunk_id_of
from chunkcache.core.generation import Backend
from chunkcache.core.ledger import ConversationLedger, DedupeMode, check_dedupe_mode
from chunkcache.core.ordering import Ordering, check_ordering, order_chunks
from chunkcache.core.prefix_tree import DEFAULT_PROMOTION_THRESHOLD, ChunkPrefixTree
from chunkcache.core.registry import ChunkRegistry
from chunkcache.core.segmenter import ChunkMatcher


@dataclass(frozen=True)
class Arrangement:
    """How one request's chunks go into the prompt.

    ``order``: chunk ids to place, in prompt order.  ``dropped``: ids left out
    because the conversation already holds them.  ``seen``: ids the conversation
    held before this request.  ``prefix_length``: how many leading chunks of
    ``order`` were a cached chunk-prefix before this request.
    """

    order: list[str]
    dropped: list[str]
    seen: frozenset[str]
    prefix_length: int


class ChunkCache:
    """Shared chunk state: access table, prefix tree, conversation ledger, registry.

    ``backend`` is a :class:`Backend` or a name: ``"local"`` (the default: the engine
    in this process), ``"http"`` (``chunkcache serve`` at ``base_url``) or ``"vllm"``
    (a vLLM server at ``base_url`` serving ``model``).  A named backend is created
    on first use.

    What it remembers, and the arguments that bound it (least recently used goes first):

    - ``window`` (default 1,000 requests): the access table counts the chunks of the last
      ``window`` requests (``window x k`` ids at most) and the prefix tree keeps at most
      ``16 x window`` nodes.  ``promotion_threshold`` is how many of those requests a chunk
      needs before the tree caches prefixes through it.
    - ``ledger``: the chunk ids each conversation has already put in its prompts.  The
      default keeps the ``2 x window`` most recently active conversations, each for 24 h
      after its last turn and with at most 2,000 ids (~200 KB); a forgotten conversation
      only has its chunks sent again.  For hundreds of thousands of live conversations
      pass ``ConversationLedger(max_conversations=..., ttl_s=...)``: memory grows with
      ``max_conversations``, so raise it only as far as a turn's dedupe is worth.
    - ``registry``: the text of recently retrieved chunks, for the LLM side to find them
      in prompts.  The default keeps ``20 x window`` chunks and at most 256 Mi characters,
      whatever the model's context window: 256 MiB of ASCII text, 512 MiB of CJK, 1 GiB
      with emoji.  Long chunks reach the character bound first (with the default window,
      those over ~13,400 characters: 5,592 of 48,000; a 128k-token model keeps the chunks
      of its last 512 window-filling prompts).  A chunk it no longer holds is sent as
      plain text until it is retrieved, so registered, again.  A bigger bound would keep
      nothing worth reusing: 256 Mi characters are ~64 M tokens of English, 1.4 TiB of
      even SmolLM2's KV (22.5 KiB a token), while the default store's 36 GiB hold ~1.7 M
      tokens.  Pass ``ChunkRegistry(max_chunks=..., max_chars=...)`` to change that.

    The backend's KV store and token cache have bounds of their own.

    >>> ChunkCache(backend="http", base_url="http://127.0.0.1:8000").stats()["requests"]
    0
    """

    def __init__(
        self,
        *,
        window: int = DEFAULT_WINDOW,
        promotion_threshold: int = DEFAULT_PROMOTION_THRESHOLD,
        namespace: str = "",
        ledger: ConversationLedger | None = None,
        registry: ChunkRegistry | None = None,
        backend: Backend | BackendName | None = None,
        base_url: str | None = None,
        model: str | None = None,
        api_key: str | None = None,
    ) -> None:
        self.namespace = namespace
        self._backend: Backend | None = None
        self._backend_spec: BackendSpec | None = None
        if backend is None or isinstance(backend, str):
            if backend is None and (base_url is not None or api_key is not None):
                raise ValueError("base_url and api_key need backend='http' or backend='vllm'")
            self._backend_spec = BackendSpec(backend or "local", base_url, model, api_key)
        elif base_url is not None or model is not None or api_key is not None:
            raise ValueError("base_url, model and api_key go with a backend name, not an object")
        else:
            self._backend = backend
        self.access_table = AccessTable(window)
        # Each request adds at most a few promoted nodes; 16 per windowed request
        # keeps the tree bounded by the window, as the access table is.
        self.prefix_tree = ChunkPrefixTree(promotion_threshold, max_nodes=16 * window)
        # Not `ledger or ...`: an empty ledger or registry has len 0 and is falsy.
        # Forgetting a conversation is always safe (its chunks are just sent again),
        # so the ledger keeps the 2 x window most recently active conversations.
        self.ledger = (
            ledger if ledger is not None else ConversationLedger(max_conversations=2 * window)
        )
        # The LLM side finds recently retrieved chunks in prompts; 20 distinct chunks
        # per windowed request covers k <= 20 with a window full of new chunks.
        self.registry = registry if registry is not None else ChunkRegistry(20 * window)
        self.matcher = ChunkMatcher(self.registry)
        self._lock = threading.Lock()
        # Building a backend can load a model for seconds: under its own lock, so the
        # retriever side (arrange, which takes _lock) never waits for it.
        self._backend_lock = threading.Lock()
        self.num_requests = 0
        if self._backend is not None:
            self._follow_evictions(self._backend)

    @property
    def backend(self) -> Backend:
        """Where prompts are run; the local engine on the default model unless one was given.

        A named backend is created on first use (the local one loads the model),
        so the retriever side never pays for it.
        """
        with self._backend_lock:
            if self._backend is None:
                assert self._backend_spec is not None
                self._backend = self._backend_spec.build()
                self._follow_evictions(self._backend)
            return self._backend

    def arrange(
        self,
        chunk_ids: Sequence[str],
        *,
        conversation_id: str | None = None,
        ordering: Ordering = "tree",
        dedupe: DedupeMode = "mark",
        count_request: bool = True,
    ) -> Arrangement:
        """Record one request's retrieved chunks and decide their prompt order.

        CRAFT §4.2: the access table counts every retrieved chunk; the chunks the
        conversation does not drop (§4.3) are ordered, and the prefix tree
        promotes or extends the chosen order.  ``count_request=False``: the request
        was counted already (this arranges it again), so the access table,
        :attr:`num_requests` and the prefix tree's visits are left as they are.
        """
        if isinstance(chunk_ids, str):
            raise TypeError("chunk_ids must be a sequence of chunk ids, not one str")
        check_ordering(ordering)
        check_dedupe_mode(dedupe)
        unique = list(dict.fromkeys(chunk_ids))
        # Before the ledger or the table changes: a bad id must fail this request only,
        # not leave a half-counted request that breaks a later one.
        for cid in unique:
            if not isinstance(cid, str):
                raise TypeError(f"chunk ids must be str, got {type(cid).__name__}")
        if conversation_id is not None:
            deduped = self.ledger.apply(conversation_id, unique, dedupe)
            kept, dropped, seen = deduped.kept, deduped.dropped, deduped.seen
        else:
            kept, dropped, seen = unique, [], frozenset()
        with self._lock:
            if count_request:
                self.num_requests += 1
                self.access_table.record(unique)
            order = order_chunks(kept, ordering, self.access_table, self.prefix_tree)
            prefix_length = self.prefix_tree.longest_prefix_length(order)
            self.prefix_tree.update(order, self.access_table.count, visit=count_request)
        return Arrangement(order=order, dropped=dropped, seen=seen, prefix_length=prefix_length)

    def _follow_evictions(self, backend: Backend) -> None:
        """Keep the prefix tree in step with the store of an in-process engine, if any."""
        store = getattr(getattr(backend, "engine", None), "store", None)
        listeners = getattr(store, "drop_listeners", None)
        contains_segment = getattr(store, "contains_segment", None)
        # optional: a store without it keeps the tree by the dropped text's variants only
        contains_chunk = getattr(store, "contains_chunk", None)
        if not isinstance(listeners, list) or contains_segment is None:
            return
        with _followers_lock:
            followers = next((f for f in listeners if isinstance(f, _EvictionFollowers)), None)
            if followers is None:
                followers = _EvictionFollowers(contains_segment, contains_chunk)
                listeners.append(followers)
            followers.caches.add(self)

    def _forget_chunk(self, chunk_id: str) -> None:
        """The store holds no KV of ``chunk_id`` any more: no prefix through it is cached."""
        with self._lock:
            self.prefix_tree.remove_chunk(chunk_id)

    def stats(self) -> dict[str, Any]:
        """Sizes of each part, for logs and benchmarks."""
        return {
            "requests": self.num_requests,
            "access_table_chunks": len(self.access_table),
            "access_table_requests": self.access_table.num_requests,
            "prefix_tree_nodes": len(self.prefix_tree),
            "conversations": len(self.ledger),
            "registered_chunks": len(self.registry),
            "registered_chars": self.registry.num_chars,
        }


class _EvictionFollowers:
    """The one drop listener a store gets, for every cache whose backend runs on it.

    It holds the caches weakly: an app may make a cache per tenant or per session on one
    shared backend, and a cache it no longer holds must not be kept alive (and called on
    every eviction) by the store's listener list.
    """

    def __init__(
        self,
        contains_segment: Callable[[str, str], bool],
        contains_chunk: Callable[[str, str], bool] | None,
    ) -> None:
        self._contains_segment = contains_segment
        self._contains_chunk = contains_chunk
        # Changed and read under _followers_lock: a WeakSet must not change while iterated.
        self.caches: weakref.WeakSet[ChunkCache] = weakref.WeakSet()

    def __call__(self, fingerprint: str, segment_id: str, context: str) -> None:
        chunk_id = chunk_id_of(segment_id)
        # contains_chunk knows the texts this process stored; contains_segment also
        # sees a variant of this text stored by another process or an earlier run.
        if self._contains_segment(fingerprint, segment_id) or (
            self._contains_chunk is not None and self._contains_chunk(fingerprint, chunk_id)
        ):
            return  # another variant of the chunk (any of its texts) is still cached
        with _followers_lock:
            caches = list(self.caches)
        for cache in caches:
            cache._forget_chunk(chunk_id)


# Guards finding or adding a store's _EvictionFollowers and its set of caches.
_followers_lock = threading.Lock()

_default_cache: ChunkCache | None = None
_default_lock = threading.Lock()


def default_cache() -> ChunkCache:
    """The process-wide cache that wrappers use when given no ``cache=``."""
    global _default_cache
    with _default_lock:
        if _default_cache is None:
            _default_cache = ChunkCache()
        return _default_cache

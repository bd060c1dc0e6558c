"""Chunk-KV variants and the in-memory store the engine keeps them in.

Every cached segment KV is a *variant*: the KV of one segment (a chunk, or a
piece of plain prompt text) computed in a known context (DESIGN: "one idea
unifies the store").  ``context`` hashes every token before the segment, so a
variant whose context equals a request's is an exact prefix hit; any other
variant of the same segment is a reuse candidate whose keys must be moved to
the new position (CacheBlend §3, Cache-Craft §3.2).  Keys are stored rotated at
their original positions ``start ...``; :meth:`Rope.shift` moves them.

Keys are namespaced by the model fingerprint, so one model's KV never reaches
another.  The tiered store (device/host/disk/Redis) implements the same
:class:`KVStore` protocol.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from chunkcache.core.chunk_ids import chunk_id_of
from chunkcache.core.craft import MIN_CFO_FOR_REUSE_COUNT, CraftMeta

log = logging.getLogger(__name__)


def segment_key(token_ids: Sequence[int]) -> str:
    """Content id of a plain-text segment: a hash of its token ids."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(b"chunkcache/text-segment/v1\x00")
    digest.update(",".join(map(str, token_ids)).encode())
    return digest.hexdigest()


def extend_context(context: str, segment_id: str) -> str:
    """The context after ``segment_id`` follows ``context`` (a hash chain over segments)."""
    return hashlib.blake2b(f"{context}/{segment_id}".encode(), digest_size=16).hexdigest()


ROOT_CONTEXT = "root"


@dataclass
class ReuseCount:
    """How often, and how cheaply, a variant was reused: Cache-Craft's frequency-reuse f_r
    (§3.3), which its eviction keeps high.  Plain numbers, saved as JSON by a tiered store.

    :meth:`record` is thread-safe: engine threads (a batching backend's, or several backends
    on one store) count reuses of one shared counter at once.
    """

    num_reuses: int = 0
    frequency_reuse: float = 0.0  # f_r = sum over reuses of 1 / CFO
    # ``+=`` reads, adds and writes back: two threads in between would lose a reuse.
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def record(self, cfo: float) -> None:
        """Count one reuse at fix overhead ``cfo`` (floored, so CFO 0 adds a finite amount)."""
        added = 1.0 / max(cfo, MIN_CFO_FOR_REUSE_COUNT)
        with self._lock:
            self.num_reuses += 1
            self.frequency_reuse += added


@dataclass(frozen=True)
class KVVariant:
    """One segment's KV, computed at positions ``start ... start + n`` after ``context``.

    ``exact`` is False when the KV before it was itself approximate (reused with
    selective recompute): such a variant is a reuse candidate, never a prefix hit.
    ``meta`` is Cache-Craft's reusability metadata, measured when the chunk was computed
    fresh under the ``cachecraft`` policy (None otherwise); ``reuse`` counts its reuses.
    """

    segment_id: str
    context: str
    start: int
    exact: bool
    k: Tensor  # [L, H_kv, n, D], rotated at positions start ... start + n - 1
    v: Tensor  # [L, H_kv, n, D]
    meta: CraftMeta | None = None
    reuse: ReuseCount = field(default_factory=ReuseCount, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.k.shape[2]

    @property
    def num_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def layers(self, layers: slice) -> tuple[Tensor, Tensor]:
        """k and v of ``layers`` (``[L', H_kv, n, D]`` each); a variant read lazily from a
        slower tier reads just those layers (:mod:`chunkcache.core.store.lazy`)."""
        return self.k[layers], self.v[layers]

    def with_tensors(self, k: Tensor, v: Tensor, reuse: ReuseCount | None = None) -> KVVariant:
        """The same variant over ``k`` and ``v`` (e.g. moved to another device), sharing
        ``reuse`` (default: this variant's counter, so a reuse counted on any copy counts)."""
        reuse = self.reuse if reuse is None else reuse
        return KVVariant(
            self.segment_id, self.context, self.start, self.exact, k, v, self.meta, reuse
        )


class KVStore(Protocol):
    """What the engine needs from a chunk-KV store."""

    def put(self, fingerprint: str, variant: KVVariant) -> None: ...

    def exact(self, fingerprint: str, segment_id: str, context: str) -> KVVariant | None:
        """The exact variant of ``segment_id`` after ``context``, if stored."""
        ...

    def variants(self, fingerprint: str, segment_id: str) -> list[KVVariant]:
        """Every stored variant of ``segment_id``, most recently used first."""
        ...


DropListener = Callable[[str, str, str], None]  # (fingerprint, segment_id, context)


class DropListeners(list[DropListener]):
    """The callables a store tells that a variant left it (ChunkCache's prefix tree
    follows evictions this way); a plain list to add to.

    :meth:`notify` calls every listener for every variant even when one raises.  A
    listener's error is logged (the first with its traceback), never raised: the store
    calls them once it is consistent again, often from deep inside a put making room (a
    tier's eviction loop, under the store's lock) for entries the caller never asked about.
    Raising would fail a request whose own KV was stored fine, and, since every later
    eviction calls the same broken listener, every request that evicts; whereas a listener
    that missed a drop costs a prefix-tree path that misses, never wrong KV.  An interrupt
    (KeyboardInterrupt, SystemExit) is the caller's own: raised once every listener heard.
    """

    def __init__(self, listeners: Iterable[DropListener] = ()) -> None:
        super().__init__(listeners)
        self.num_errors = 0
        self._lock = threading.Lock()

    def notify(self, dropped: Iterable[tuple[str, str, str]]) -> None:
        """Tell every listener of every ``(fingerprint, segment_id, context)`` dropped."""
        interrupt: BaseException | None = None
        for names in dropped:
            for listener in list(self):  # a listener may be added meanwhile (another thread)
                try:
                    listener(*names)
                except Exception:
                    self._failed(names[1])
                except BaseException as error:
                    interrupt = interrupt or error
        if interrupt is not None:
            raise interrupt

    def _failed(self, segment_id: str) -> None:
        with self._lock:
            self.num_errors += 1
            first = self.num_errors == 1
        level = logging.WARNING if first else logging.DEBUG
        log.log(level, "a drop listener failed on %s", segment_id, exc_info=first)


def holds_segment(store: KVStore, fingerprint: str, segment_id: str) -> bool:
    """Whether ``store`` holds any variant of ``segment_id``.  Asked of a store that can tell
    without a use (``contains_segment``), it is not one: asking must not reorder the LRU."""
    contains = getattr(store, "contains_segment", None)
    if callable(contains):
        return bool(contains(fingerprint, segment_id))
    return bool(store.variants(fingerprint, segment_id))


class MemoryKVStore:
    """Variants in host (or device) memory, least recently used evicted past ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int = 4 * 2**30) -> None:
        if capacity_bytes < 1:
            raise ValueError("capacity_bytes must be positive")
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self.num_evictions = 0
        self._entries: OrderedDict[tuple[str, str, str], KVVariant] = OrderedDict()
        # Each segment's contexts, least recently used first (as in _entries).
        self._by_segment: dict[tuple[str, str], dict[str, None]] = {}
        # (fingerprint, chunk id) -> the segment ids of that chunk held (chunk_ids.chunk_key).
        self._by_chunk: dict[tuple[str, str], set[str]] = {}
        self._lock = threading.Lock()
        # Called as listener(fingerprint, segment_id, context) after a variant is evicted.
        self.drop_listeners = DropListeners()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, fingerprint: str, variant: KVVariant) -> None:
        if variant.num_bytes > self.capacity_bytes:
            return
        key = (fingerprint, variant.segment_id, variant.context)
        evicted: list[tuple[str, str, str]] = []
        with self._lock:
            self._drop(key)
            self._entries[key] = variant
            self._by_segment.setdefault(key[:2], {})[variant.context] = None
            self._by_chunk.setdefault((fingerprint, chunk_id_of(key[1])), set()).add(key[1])
            self.num_bytes += variant.num_bytes
            while self.num_bytes > self.capacity_bytes:
                evicted.append(next(iter(self._entries)))
                self._drop(evicted[-1])
                self.num_evictions += 1
        # outside the lock, the store consistent: a listener may call back into it
        self.drop_listeners.notify(evicted)

    def exact(self, fingerprint: str, segment_id: str, context: str) -> KVVariant | None:
        key = (fingerprint, segment_id, context)
        with self._lock:
            variant = self._entries.get(key)
            if variant is None or not variant.exact:
                return None
            self._touch(key)
            return variant

    def variants(self, fingerprint: str, segment_id: str) -> list[KVVariant]:
        with self._lock:
            contexts = self._by_segment.get((fingerprint, segment_id), {})
            keys = [(fingerprint, segment_id, context) for context in contexts]
            for key in keys:  # all touched, their order kept
                self._touch(key)
            return [self._entries[key] for key in reversed(keys)]  # most recently used first

    def contains_segment(self, fingerprint: str, segment_id: str) -> bool:
        """Whether any variant of ``segment_id`` is held (without touching recency)."""
        with self._lock:
            return (fingerprint, segment_id) in self._by_segment

    def contains_chunk(self, fingerprint: str, chunk_id: str) -> bool:
        """Whether any variant of any segment of ``chunk_id`` (a
        :func:`~chunkcache.core.chunk_ids.chunk_key` per text sent under it) is held."""
        with self._lock:
            return (fingerprint, chunk_id) in self._by_chunk

    def _touch(self, key: tuple[str, str, str]) -> None:
        self._entries.move_to_end(key)
        contexts = self._by_segment[key[:2]]
        contexts[key[2]] = contexts.pop(key[2])  # to the end: the most recent

    def _drop(self, key: tuple[str, str, str]) -> None:
        variant = self._entries.pop(key, None)
        if variant is None:
            return
        self.num_bytes -= variant.num_bytes
        contexts = self._by_segment[key[:2]]
        del contexts[key[2]]
        if not contexts:
            del self._by_segment[key[:2]]
            segments = self._by_chunk[(key[0], chunk_id_of(key[1]))]
            segments.discard(key[1])
            if not segments:
                del self._by_chunk[(key[0], chunk_id_of(key[1]))]

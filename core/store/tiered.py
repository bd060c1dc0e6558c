"""The tiered chunk-KV store: device / host / disk / Redis behind the engine's KVStore.

A variant lives in the fastest tier that holds it.  A hit in a lower tier copies it up to
the fastest tier (promotion) and leaves the lower copy where it is; when the fastest tier is
full its policy picks a victim, which moves one tier down unless a lower tier already holds a
copy, in which case it is just dropped (RAGCache §5.1, swap out only once, multi-level
eviction); the last tier drops for good.  Cache-Craft §3.5 keeps frequently reused variants
high the same way.  A corrupt entry found in any tier is dropped, counted and treated as a
miss (the engine recomputes it).

Reads: :meth:`TieredKVStore.variants` (the chunks a request places) reads a disk hit lazily:
only its header at lookup, its layers when the placement reads them, layer ``l + 1`` while
layer ``l`` computes (:class:`~chunkcache.core.store.lazy.LazyKVVariant`); the whole variant
is promoted once its last layer is in, and a layer that fails its checksum drops the entry
then (the engine runs the request again).  ``load_seconds`` is the time spent reading the
tier, wherever it is spent.  :meth:`exact` (prefix hits, copied before compute starts),
prefetch and demotion read whole entries; so does the Redis tier always: a round trip per
layer would cost more than it hides.  Every count is in :meth:`TieredKVStore.metrics`; one
request's counts come from :meth:`TieredKVStore.track`.

The store's parts: :mod:`.tiered_reads` (whole and lazy reads, prefetch, failures as
misses), :mod:`.tiered_moves` (insert, promote, demote, write-through, and the
backfill of a shared tier that was down, :mod:`.backfill`), :mod:`.tiered_drops` (entries
leaving the store, failures counted) and :mod:`.tiered_stats` (the per-entry statistics the
policies read).

Example::

    store = TieredKVStore.from_settings(host_bytes=2**30, policy="pgdsf")  # or explicit tiers:
    store = TieredKVStore([MemoryTier("host", 2**30), DiskTier(path, 2**34)], policy="pgdsf")
    engine = ChunkEngine(lm, store)
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from chunkcache.core.kv_store import DropListeners, KVVariant
from chunkcache.core.store.backfill import PendingWrites
from chunkcache.core.store.codec import EntryKey, entry_key, namespace_of
from chunkcache.core.store.codec import segment_of as segment_hash
from chunkcache.core.store.cost import PrefillCostModel
from chunkcache.core.store.metrics import StoreMetrics, StoreUsage
from chunkcache.core.store.policies import PGDSFPolicy, make_policy
from chunkcache.core.store.tier import Tier
from chunkcache.core.store.tiered_reads import TieredReads

if TYPE_CHECKING:
    from chunkcache.core.store.settings import StoreSettings

log = logging.getLogger(__name__)
T = TypeVar("T")
# KV bytes queued write-throughs may hold: each holds its variant until a busy disk or Redis
# takes it, and ~6 MB a 256-token chunk (SmolLM2, bf16) soon makes GBs of an unbounded queue.
WRITE_THROUGH_BACKLOG_BYTES = 256 * 2**20


class TieredKVStore(TieredReads):
    """A :class:`~chunkcache.core.kv_store.KVStore` over ``tiers``, fastest first.

    ``policy`` names the eviction policy every local tier runs (``lru``, ``lfu``, ``pgdsf``,
    ``cachecraft``); the Redis tier evicts least recently used, server-side.
    ``write_through`` also writes every new variant to the lower tiers (disk, Redis) on a
    background thread, so other processes and the next start see it without waiting for an
    eviction (RAG-DCache keeps chunk KV on disk); a later eviction then just drops the copy.
    A write-through Redis missed while down is made once it answers again, if a local tier
    still holds the entry.  Queued write-throughs hold at most ``write_through_backlog_bytes``
    of KV (or one variant, whatever its size): one past that is skipped and counted
    (``write_through_skipped``), and its entry goes down when the fastest tier evicts it.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        policy: str = "lru",
        write_through: bool = False,
        write_through_backlog_bytes: int = WRITE_THROUGH_BACKLOG_BYTES,
    ) -> None:
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        self.tiers = list(tiers)
        self.policy_name = policy
        self.write_through = write_through
        self.write_through_backlog_bytes = write_through_backlog_bytes
        self._backlog_bytes = 0  # KV held by queued and running write-throughs
        self.cost_model = PrefillCostModel()
        self.policies = [make_policy(policy) for _ in self.tiers]
        for p in self.policies:
            if isinstance(p, PGDSFPolicy):
                p.default_cost = self._estimated_cost
        self._init_stats()
        # called with (fingerprint, segment_id, context) when a variant leaves the store
        self.drop_listeners = DropListeners()
        self._metrics = StoreMetrics([t.name for t in self.tiers])
        self._io_warned: set[str] = set()
        self._whole_until: dict[str, float] = {}  # tier name -> monotonic end of whole reads
        self._lock = threading.RLock()
        self._background: ThreadPoolExecutor | None = None
        self._closed = False
        self._pending = {}
        self._backfill_queued = set()
        self._newer = {}
        self._num_puts = 0
        for i, tier in enumerate(self.tiers):  # shared tiers that say when they are back
            up_listeners = getattr(tier, "up_listeners", None)
            if isinstance(up_listeners, list):
                self._pending[i] = PendingWrites()
                up_listeners.append(functools.partial(self._queue_backfill, i))

    # -- KVStore ---------------------------------------------------------------------------

    def put(self, fingerprint: str, variant: KVVariant) -> None:
        key = entry_key(fingerprint, variant.segment_id, variant.context)
        self._metrics.store("puts")
        with self._lock:
            known = key in self.stats
            stats = self._touch(key, fingerprint, variant, count=True)
            stats.reuse = variant.reuse
            try:
                placed = self._insert(0, key, fingerprint, variant)
            except BaseException:  # the caller's error (or Ctrl-C): counted, yet in no tier
                self._not_placed(key, known)
                raise
            if placed is None:  # fits in no tier
                self._not_placed(key, known)
                return
            self._num_puts += 1
            number = self._num_puts
            if len(self.tiers) > 1:  # lower tiers may hold an older variant of ``key``
                self._newer[key] = number
            if len(self.stats) > self._stats_limit:
                self._prune_stats()
                self._newer = {k: n for k, n in self._newer.items() if k in self.stats}
        if self.write_through and len(self.tiers) > 1:
            if self._hold_for_write_through(variant.num_bytes):
                self._submit(self._write_through, key, fingerprint, variant, number)
            else:  # ``_newer`` still names it: written down when evicted
                self._metrics.store("write_through_skipped")

    def exact(self, fingerprint: str, segment_id: str, context: str) -> KVVariant | None:
        key = entry_key(fingerprint, segment_id, context)
        self._metrics.store("lookups")
        for i in range(len(self.tiers)):
            variant = self._load(i, key, fingerprint)
            if variant is not None and variant.exact:
                self._metrics.store("hits")
                return self._hit(i, key, fingerprint, variant)
            self._metrics.tier(self.tiers[i].name, "misses")
            if variant is not None:
                break  # approximate KV: every copy of it is, never a prefix hit
        self._metrics.store("misses")
        return None

    def variants(self, fingerprint: str, segment_id: str) -> list[KVVariant]:
        ns, seg, fp = namespace_of(fingerprint), segment_hash(segment_id), fingerprint
        self._metrics.store("lookups")
        found: dict[EntryKey, KVVariant] = {}
        for i, tier in enumerate(self.tiers):
            hit = False
            for key in tier.segment_keys(ns, seg):
                if key not in found and (variant := self._load_lazy(i, key, fp)) is not None:
                    found[key] = self._hit(i, key, fingerprint, variant, count=False)
                    hit = True
            if not hit:
                self._metrics.tier(tier.name, "misses")
        self._metrics.store("hits" if found else "misses")
        with self._lock:  # most recently used first, then all touched in that order
            order = sorted(found, key=lambda k: -self._stats_of(k).last_used)
            for key in reversed(order):
                self._touch(key, fingerprint, found[key], count=True)
                self._retouch(key)
        return [found[key] for key in order]

    # -- beyond KVStore --------------------------------------------------------------------

    def record_prefill(
        self,
        fingerprint: str,
        computed: Sequence[tuple[str, str]],
        cached_tokens: int,
        new_tokens: int,
        seconds: float,
    ) -> None:
        """One prefill took ``seconds`` for ``new_tokens`` after ``cached_tokens`` reused ones,
        computing the ``(segment_id, context)`` variants in ``computed``: PGDSF's cost
        (RAGCache Formula 4, Cost_i / NewSize_i) for each, and a profile point."""
        self.cost_model.record(cached_tokens, new_tokens, seconds)
        with self._lock:
            for segment_id, context in computed:
                key = entry_key(fingerprint, segment_id, context)
                if key in self.stats:
                    self.stats[key].record_cost(seconds, new_tokens)
                    self._retouch(key)

    @classmethod
    def from_settings(
        cls, settings: StoreSettings | None = None, **overrides: Any
    ) -> TieredKVStore:
        """The store :class:`StoreSettings` describe (environment, file, ``overrides``)."""
        from chunkcache.core.store.settings import StoreSettings, build_tiers

        settings = settings if settings is not None else StoreSettings(**overrides)
        return cls(
            build_tiers(settings),
            settings.policy,
            settings.write_through,
            settings.write_through_backlog_bytes,
        )

    def prefetch(self, fingerprint: str, segment_ids: Sequence[str]) -> Future[int]:
        """Start copying every stored variant of ``segment_ids`` up to the fastest tier in the
        background, e.g. while the request waits in a queue (RAG-DCache §III, Cache-Craft
        §3.5).  The future gives the number of variants moved up."""
        return self._submit(self._promote_segments, fingerprint, list(segment_ids))

    def contains_segment(self, fingerprint: str, segment_id: str) -> bool:
        """Whether any tier holds a variant of ``segment_id`` (no loading, no counting)."""
        ns, seg = namespace_of(fingerprint), segment_hash(segment_id)
        return any(tier.segment_keys(ns, seg) for tier in self.tiers)

    def contains_chunk(self, fingerprint: str, chunk_id: str) -> bool:
        """Whether any tier holds a variant of any segment of ``chunk_id`` (a
        :func:`~chunkcache.core.chunk_ids.chunk_key` per text sent under that id) that this
        store wrote or read.

        A segment only another process (or an earlier run) stored is not known here: tiers
        index entries by segment hash, so seeing it would take a chunk index in every
        shared tier, kept on every write and eviction, for answers that rarely change.
        ``ChunkCache`` asks this only after a drop, once :meth:`contains_segment` (which
        sees every process's entries) said no; ids the retrievers give are content-bound,
        one text and so one segment each; and with Redis below, an entry leaves the store
        only when Redis refused it, mostly while down, when Redis cannot be read either.
        What is left: caller-chosen ids sent with other texts by processes sharing a disk.
        """
        with self._lock:
            segment_ids = self._segments_of_chunk(fingerprint, chunk_id)
        return any(self.contains_segment(fingerprint, s) for s in segment_ids)

    def flush(self) -> None:
        """Wait until every background write and prefetch submitted so far is done."""
        self._submit(lambda: None).result()

    def metrics(self) -> dict[str, Any]:
        """Counters and gauges: ``{"policy", "lookups", "hits", "misses", "puts",
        "write_through_skipped", "corrupt_dropped", "tiers": {name: {capacity_bytes, bytes,
        entries, hits, misses, evictions, demotions, promotions, prefetched, corrupt_dropped,
        load_seconds, bytes_loaded, errors, backfilled}}}``; Redis also has ``up``,
        ``backfill_pending`` (write-throughs missed while down, still to make) and
        ``backfill_forgotten``."""
        out = self._metrics.snapshot()
        for i, tier in enumerate(self.tiers):
            counts = out["tiers"][tier.name]
            counts.update(capacity_bytes=tier.capacity_bytes, bytes=tier.num_bytes)
            counts["entries"] = len(tier)
            if hasattr(tier, "up"):  # Redis: what it refused or evicted server-side it
                # counts itself (that request misses, never fails); a full Redis must not
                # show no errors
                counts["up"] = tier.up
                counts["errors"] += getattr(tier, "num_errors", 0)
                counts["evictions"] += getattr(tier, "num_evictions", 0)
            if i in self._pending:
                with self._lock:
                    counts["backfill_pending"] = len(self._pending[i])
                    counts["backfill_forgotten"] = self._pending[i].num_forgotten
        out["corrupt_dropped"] = sum(c["corrupt_dropped"] for c in out["tiers"].values())
        out["policy"] = self.policy_name
        return out

    def load_bandwidth(self) -> dict[str, float]:
        """Measured bytes per second loaded from each lower tier: the CacheBlend loading
        controller's T_load estimator (§5.1).  Tiers no layer bytes were read from yet (never
        read, or only lazy headers opened) are left out, never given a bandwidth of 0."""
        tiers = self._metrics.snapshot()["tiers"]
        return {
            name: counts["bytes_loaded"] / counts["load_seconds"]
            for name, counts in tiers.items()
            if counts["load_seconds"] > 0 and counts["bytes_loaded"] > 0
        }

    def snapshot(self) -> dict[str, Any]:
        """Counters only (cheap): pass two of them to :func:`metrics.delta`."""
        return self._metrics.snapshot()

    @contextmanager
    def track(self) -> Iterator[StoreUsage]:
        """This request's store counts: ``with store.track() as usage: ...; usage.as_dict()``."""
        with self._metrics.track() as usage:
            yield usage

    def close(self) -> None:
        """Wait for background work, then release the tiers' connections.  Work submitted
        later (a request still finishing while a server shuts down) runs inline, on tiers a
        Redis client may reconnect to."""
        with self._lock:
            self._closed = True
            background = self._background
        if background is not None:
            background.shutdown(wait=True)
        for tier in self.tiers:
            close: Callable[[], None] | None = getattr(tier, "close", None)
            if close is not None:
                close()

    # -- internals -------------------------------------------------------------------------

    def _hold_for_write_through(self, num_bytes: int) -> bool:
        """Whether a write-through of ``num_bytes`` of KV may queue: the backlog stays within
        its cap, or is empty (a variant larger than the cap goes alone)."""
        with self._lock:
            backlog = self._backlog_bytes
            if backlog and backlog + num_bytes > self.write_through_backlog_bytes:
                return False
            self._backlog_bytes = backlog + num_bytes
            return True

    def _submit(self, call: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``call`` on the one background thread (in submission order); a failure is
        logged (nobody may be waiting on the future) and left in the future."""

        def logged() -> T:
            try:
                return call(*args)
            except Exception:
                log.exception("chunkcache store: background %s failed", call.__name__)
                raise

        with self._lock:
            if not self._closed:
                if self._background is None:
                    self._background = ThreadPoolExecutor(1, thread_name_prefix="chunkcache-store")
                return self._background.submit(logged)
        done: Future[T] = Future()  # closed: no pool to run on, so here and now
        try:
            done.set_result(logged())
        except Exception as error:
            done.set_exception(error)
        return done

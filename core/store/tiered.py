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

Example::

    store = TieredKVStore.from_settings(host_bytes=2**30, policy="pgdsf")  # or explicit tiers:
    store = TieredKVStore([MemoryTier("host", 2**30), DiskTier(path, 2**34)], policy="pgdsf")
    engine = ChunkEngine(lm, store)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from chunkcache.core.kv_store import KVVariant, ReuseCount
from chunkcache.core.store import codec
from chunkcache.core.store.codec import CorruptEntryError, EntryKey, entry_key, namespace_of
from chunkcache.core.store.codec import segment_of as segment_hash
from chunkcache.core.store.cost import PrefillCostModel
from chunkcache.core.store.lazy import LazyEvents, LazyKVVariant
from chunkcache.core.store.metrics import StoreMetrics, StoreUsage
from chunkcache.core.store.policies import EntryStats, PGDSFPolicy, make_policy
from chunkcache.core.store.tier import Evicted, Loader, Tier, Victim

if TYPE_CHECKING:
    from chunkcache.core.store.settings import StoreSettings

log = logging.getLogger(__name__)
T = TypeVar("T")
STATS_SLACK = 10_000  # statistics kept beyond the local entries before pruning


class TieredKVStore:
    """A :class:`~chunkcache.core.kv_store.KVStore` over ``tiers``, fastest first.

    ``policy`` names the eviction policy every local tier runs (``lru``, ``lfu``, ``pgdsf``,
    ``cachecraft``); the Redis tier evicts least recently used, server-side.
    ``write_through`` also writes every new variant to the lower tiers (disk, Redis) on a
    background thread, so other processes and the next start see it without waiting for an
    eviction (RAG-DCache keeps chunk KV on disk); a later eviction then just drops the copy.
    """

    def __init__(
        self, tiers: Sequence[Tier], policy: str = "lru", write_through: bool = False
    ) -> None:
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        self.tiers = list(tiers)
        self.policy_name = policy
        self.write_through = write_through
        self.cost_model = PrefillCostModel()
        self.policies = [make_policy(policy) for _ in self.tiers]
        for p in self.policies:
            if isinstance(p, PGDSFPolicy):
                p.default_cost = self._estimated_cost
        self.stats: dict[EntryKey, EntryStats] = {}
        # called with (fingerprint, segment_id, context) when a variant leaves the store
        self.drop_listeners: list[Callable[[str, str, str], None]] = []
        self._metrics = StoreMetrics([t.name for t in self.tiers])
        self._tick = 0
        self._stats_limit = STATS_SLACK
        self._io_warned: set[str] = set()
        self._lock = threading.RLock()
        self._background: ThreadPoolExecutor | None = None

    # -- KVStore ---------------------------------------------------------------------------

    def put(self, fingerprint: str, variant: KVVariant) -> None:
        key = entry_key(fingerprint, variant.segment_id, variant.context)
        self._metrics.store("puts")
        with self._lock:
            stats = self._touch(key, fingerprint, variant, count=True)
            stats.reuse = variant.reuse
            self._insert(0, key, fingerprint, variant)
            if len(self.stats) > self._stats_limit:
                self._prune_stats()
        if self.write_through and len(self.tiers) > 1:
            self._submit(self._write_through, key, fingerprint, variant)

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
        return cls(build_tiers(settings), settings.policy, settings.write_through)

    def prefetch(self, fingerprint: str, segment_ids: Sequence[str]) -> Future[int]:
        """Start copying every stored variant of ``segment_ids`` up to the fastest tier in the
        background, e.g. while the request waits in a queue (RAG-DCache §III, Cache-Craft
        §3.5).  The future gives the number of variants moved up."""
        return self._submit(self._promote_segments, fingerprint, list(segment_ids))

    def contains_segment(self, fingerprint: str, segment_id: str) -> bool:
        """Whether any tier holds a variant of ``segment_id`` (no loading, no counting)."""
        ns, seg = namespace_of(fingerprint), segment_hash(segment_id)
        return any(tier.segment_keys(ns, seg) for tier in self.tiers)

    def flush(self) -> None:
        """Wait until every background write and prefetch submitted so far is done."""
        self._submit(lambda: None).result()

    def metrics(self) -> dict[str, Any]:
        """Counters and gauges: ``{"policy", "lookups", "hits", "misses", "puts",
        "corrupt_dropped", "tiers": {name: {capacity_bytes, bytes, entries, hits, misses,
        evictions, demotions, promotions, prefetched, corrupt_dropped, load_seconds,
        bytes_loaded}}}``."""
        out = self._metrics.snapshot()
        for tier in self.tiers:
            counts = out["tiers"][tier.name]
            counts.update(capacity_bytes=tier.capacity_bytes, bytes=tier.num_bytes)
            counts["entries"] = len(tier)
            if hasattr(tier, "up"):
                counts["up"] = tier.up
        out["corrupt_dropped"] = sum(c["corrupt_dropped"] for c in out["tiers"].values())
        out["policy"] = self.policy_name
        return out

    def load_bandwidth(self) -> dict[str, float]:
        """Measured bytes per second loaded from each lower tier (tiers never read from are
        left out): the CacheBlend loading controller's T_load estimator (§5.1)."""
        tiers = self._metrics.snapshot()["tiers"]
        return {
            name: counts["bytes_loaded"] / counts["load_seconds"]
            for name, counts in tiers.items()
            if counts["load_seconds"] > 0
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
        """Wait for background work, then release the tiers' connections."""
        if self._background is not None:
            self._background.shutdown(wait=True)
        for tier in self.tiers:
            close: Callable[[], None] | None = getattr(tier, "close", None)
            if close is not None:
                close()

    # -- internals -------------------------------------------------------------------------

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
            if self._background is None:
                self._background = ThreadPoolExecutor(1, thread_name_prefix="chunkcache-store")
        return self._background.submit(logged)

    def _write_through(self, key: EntryKey, fingerprint: str, variant: KVVariant) -> None:
        """Copy a new variant to every lower tier, holding the store lock only while a tier
        makes room: encoding and fsyncing happen unlocked, so requests are not held up."""
        for i, tier in enumerate(self.tiers[1:], start=1):
            if key in tier:
                continue
            if getattr(tier, "self_evicting", False):  # needs no policy: no lock either
                tier.put(key, fingerprint, variant, *self._callbacks(i, key))
                continue
            prepare = getattr(tier, "prepare", None)
            try:
                prepared = prepare(key, fingerprint, variant) if prepare is not None else None
            except OSError as error:
                self._io_error(tier, error)
                continue
            with self._lock:
                if prepared is not None:
                    try:
                        committed = tier.commit(prepared, *self._callbacks(i, key))  # type: ignore[attr-defined]
                    except OSError as error:
                        self._io_error(tier, error)
                        continue
                    if committed:
                        self.policies[i].touched(key, self._stats_of(key))
                elif prepare is None:
                    self._insert(i, key, fingerprint, variant, fall_through=False)

    def _load(self, i: int, key: EntryKey, fingerprint: str) -> KVVariant | None:
        tier = self.tiers[i]
        started = time.perf_counter()
        variant = self._guarded(tier, lambda: tier.get(key, fingerprint))
        if variant is not None and i > 0:
            self._metrics.tier(tier.name, "load_seconds", time.perf_counter() - started)
            self._metrics.tier(tier.name, "bytes_loaded", variant.num_bytes)
        return variant

    def _load_lazy(self, i: int, key: EntryKey, fingerprint: str) -> KVVariant | None:
        """Tier ``i``'s entry with only its header read, when the tier reads layers on
        demand (disk); a whole read otherwise."""
        tier = self.tiers[i]
        open_lazy = getattr(tier, "open_lazy", None)
        if i == 0 or open_lazy is None:
            return self._load(i, key, fingerprint)
        started = time.perf_counter()
        opened = self._guarded(tier, lambda: open_lazy(key, fingerprint))
        if opened is None:
            return None
        self._metrics.tier(tier.name, "load_seconds", time.perf_counter() - started)
        header, layers = opened
        with self._lock:
            reuse = self._adopted_reuse(key, codec.reuse_of(header))
        events = self._lazy_events(i, key, fingerprint)
        return LazyKVVariant.from_header(header, reuse, layers, tier.name, events)

    def _lazy_events(self, i: int, key: EntryKey, fingerprint: str) -> LazyEvents:
        """Count a lazy variant's layer reads, promote it when whole, drop it if corrupt."""
        tier = self.tiers[i]

        def read(seconds: float, num_bytes: int) -> None:
            self._metrics.tier(tier.name, "load_seconds", seconds)
            self._metrics.tier(tier.name, "bytes_loaded", num_bytes)

        def complete(variant: KVVariant) -> None:
            with self._lock:
                self._promote(i, key, fingerprint, variant)

        def corrupt(error: CorruptEntryError) -> None:
            self._corrupt(tier, error)
            with contextlib.suppress(OSError):
                tier.remove(key)

        return LazyEvents(read, complete, corrupt)

    def _guarded(self, tier: Tier, read: Callable[[], T]) -> T | None:
        """``read()`` from ``tier``; a corrupt entry or a failing tier is a miss."""
        try:
            return read()
        except CorruptEntryError as error:
            self._corrupt(tier, error)
        except OSError as error:  # a failing disk is a miss, never a failed request
            self._io_error(tier, error)
        return None

    def _corrupt(self, tier: Tier, error: CorruptEntryError) -> None:
        log.warning("dropped a corrupt entry from the %s tier: %s", tier.name, error)
        self._metrics.tier(tier.name, "corrupt_dropped")

    def _hit(
        self, i: int, key: EntryKey, fingerprint: str, variant: KVVariant, count: bool = True
    ) -> KVVariant:
        self._metrics.tier(self.tiers[i].name, "hits")
        with self._lock:
            variant = self._adopt(key, variant)
            if count:
                self._touch(key, fingerprint, variant, count=True)
            if i > 0 and not isinstance(variant, LazyKVVariant):  # lazy: once read whole
                variant = self._promote(i, key, fingerprint, variant)
            self._retouch(key)
        return variant

    def _promote(self, i: int, key: EntryKey, fingerprint: str, variant: KVVariant) -> KVVariant:
        """Copy up to the fastest tier; the lower copy stays (swap out only once)."""
        placed = self._insert(0, key, fingerprint, variant, fall_through=False)
        if placed == 0:
            self._metrics.tier(self.tiers[i].name, "promotions")
            return self.tiers[0].get(key, fingerprint) or variant
        return variant

    def _insert(
        self, i: int, key: EntryKey, fingerprint: str, variant: KVVariant, fall_through: bool = True
    ) -> int | None:
        """Put into tier ``i`` (or the first lower tier it fits in); the tier it landed in."""
        for j in range(i, len(self.tiers) if fall_through else i + 1):
            try:
                placed = self.tiers[j].put(key, fingerprint, variant, *self._callbacks(j, key))
            except OSError as error:  # full or failing disk: try the next tier
                self._io_error(self.tiers[j], error)
                continue
            if placed:
                self.policies[j].touched(key, self._stats_of(key))
                return j
        return None

    def _io_error(self, tier: Tier, error: OSError) -> None:
        """Count an I/O failure of ``tier``; the first one is logged as a warning."""
        self._metrics.tier(tier.name, "errors")
        level = logging.DEBUG if tier.name in self._io_warned else logging.WARNING
        self._io_warned.add(tier.name)
        log.log(level, "the %s tier failed (%s): treated as a miss", tier.name, error)

    def _callbacks(self, j: int, key: EntryKey) -> tuple[Victim, Evicted]:
        """How tier ``j`` makes room for ``key``: its policy's victim, then demotion."""
        policy = self.policies[j]

        def victim(keys: list[EntryKey]) -> EntryKey:
            return policy.victim([k for k in keys if k != key], self._stats_of)

        def evicted(out: EntryKey, loader: Loader) -> None:
            self._evicted(j, out, loader)

        return victim, evicted

    def _evicted(self, i: int, key: EntryKey, loader: Loader) -> None:
        """Tier ``i`` evicted ``key``: move it one tier down unless a copy is already below
        (swap out only once), else it is gone for good."""
        self._metrics.tier(self.tiers[i].name, "evictions")
        self.policies[i].evicted(key, self._stats_of(key))
        lower = self.tiers[i + 1 :]
        if any(key in tier for tier in lower):
            return
        loaded = loader() if lower else None
        if loaded is not None and self._insert(i + 1, key, loaded[0], loaded[1]) is not None:
            self._metrics.tier(self.tiers[i].name, "demotions")
        else:
            self._dropped(key)

    def _prune_stats(self) -> None:
        """Forget statistics of entries no local tier holds (Redis and other processes
        evict without telling us); a later load seeds them afresh."""
        local: set[EntryKey] = set()
        for tier in self.tiers:
            entry_keys = getattr(tier, "entry_keys", None)
            if entry_keys is not None and not getattr(tier, "self_evicting", False):
                local.update(entry_keys())
        for key in [k for k in self.stats if k not in local]:
            del self.stats[key]
            for policy in self.policies:
                policy.forget(key)
        self._stats_limit = 2 * len(self.stats) + STATS_SLACK

    def _dropped(self, key: EntryKey) -> None:
        """``key`` left the last tier holding it: forget it, tell the listeners."""
        stats = self.stats.pop(key, None)
        for policy in self.policies:
            policy.forget(key)
        if stats is not None and stats.names is not None:
            for listener in self.drop_listeners:
                listener(*stats.names)

    def _promote_segments(self, fingerprint: str, segment_ids: list[str]) -> int:
        ns, moved = namespace_of(fingerprint), 0
        for segment_id in segment_ids:
            seg = segment_hash(segment_id)
            top = set(self.tiers[0].segment_keys(ns, seg))
            for i in range(1, len(self.tiers)):
                for key in self.tiers[i].segment_keys(ns, seg):
                    if key in top or (variant := self._load(i, key, fingerprint)) is None:
                        continue
                    with self._lock:
                        self._touch(key, fingerprint, variant, count=False)
                        if self._insert(0, key, fingerprint, self._adopt(key, variant), False) == 0:
                            self._metrics.tier(self.tiers[i].name, "prefetched")
                            top.add(key)
                            moved += 1
        return moved

    def _stats_of(self, key: EntryKey) -> EntryStats:
        stats = self.stats.get(key)
        if stats is None:  # stored by another process or an earlier run
            stats = self.stats[key] = EntryStats(0, 0)
            for tier in self.tiers:
                reuse_of = getattr(tier, "reuse_of", None)
                reuse = reuse_of(key) if reuse_of is not None else None
                if reuse is not None:
                    stats.reuse = reuse
                    break
        return stats

    def _touch(
        self, key: EntryKey, fingerprint: str, variant: KVVariant, count: bool
    ) -> EntryStats:
        self._tick += 1
        stats = self._stats_of(key)
        stats.names = (fingerprint, variant.segment_id, variant.context)
        stats.num_bytes, stats.num_tokens = variant.num_bytes, variant.num_tokens
        stats.last_used = self._tick
        stats.frequency += count
        return stats

    def _retouch(self, key: EntryKey) -> None:
        """Let PGDSF recompute the priority of ``key`` in each local tier that holds it
        (Algorithm 1 line 9); the other policies read the statistics when they evict."""
        stats = self._stats_of(key)
        for tier, policy in zip(self.tiers, self.policies, strict=True):
            local = not getattr(tier, "self_evicting", False)
            if isinstance(policy, PGDSFPolicy) and local and key in tier:
                policy.touched(key, stats)

    def _adopt(self, key: EntryKey, variant: KVVariant) -> KVVariant:
        """One live reuse counter per entry: a copy loaded from below shares it."""
        reuse = self._adopted_reuse(key, variant.reuse)
        if reuse is variant.reuse:
            return variant
        return KVVariant(
            variant.segment_id,
            variant.context,
            variant.start,
            variant.exact,
            variant.k,
            variant.v,
            variant.meta,
            reuse,
        )

    def _adopted_reuse(self, key: EntryKey, reuse: ReuseCount) -> ReuseCount:
        """The entry's live counter, raised to ``reuse`` (a copy's) if that counted more."""
        stats = self._stats_of(key)
        if stats.reuse is not reuse and stats.reuse.frequency_reuse < reuse.frequency_reuse:
            stats.reuse.num_reuses = reuse.num_reuses
            stats.reuse.frequency_reuse = reuse.frequency_reuse
        return stats.reuse

    def _estimated_cost(self, stats: EntryStats) -> float:
        """Per-token cost of an entry no request measured: from the prefill profile."""
        if len(self.cost_model) == 0 or stats.num_tokens == 0:
            return 1.0
        return self.cost_model.per_token(0, stats.num_tokens)

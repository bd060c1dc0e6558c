"""How the tiered store reads: whole entries, lazy disk hits, prefetch, failures as misses.

:meth:`TieredReads._load` reads a whole entry (exact prefix hits, prefetch, Redis).
:meth:`TieredReads._load_lazy` reads only a disk entry's header and hands out a
:class:`~chunkcache.core.store.lazy.LazyKVVariant` whose layers are read when placed; its
events count each layer's read, promote the variant once whole, and drop the entry when a
layer fails its checksum (``corrupt_dropped``) or its read (the tier's ``errors``).  An entry
dropped on read that no other tier holds leaves the store: its statistics are forgotten and
the drop listeners told, as for an eviction.  A hit whose copy up fails is served from below.

After a layer's read failed, the tier's hits are read whole for :data:`WHOLE_AFTER_IO_ERROR_S`
seconds: a failing disk then fails at lookup, a miss, instead of mid-prefill, so the
engine's one rerun of the request does not meet the same failure in another entry.
"""

from __future__ import annotations

import contextlib
import time

from chunkcache.core.kv_store import KVVariant
from chunkcache.core.store import codec
from chunkcache.core.store.codec import CorruptEntryError, EntryKey, namespace_of
from chunkcache.core.store.codec import segment_of as segment_hash
from chunkcache.core.store.lazy import LayerReadError, LazyEvents, LazyKVVariant
from chunkcache.core.store.tiered_moves import TieredMoves

WHOLE_AFTER_IO_ERROR_S = 30.0  # a tier that failed a lazy read is read whole this long


class TieredReads(TieredMoves):
    """The reading part of :class:`~chunkcache.core.store.tiered.TieredKVStore`."""

    _whole_until: dict[str, float]

    def _load(self, i: int, key: EntryKey, fingerprint: str) -> KVVariant | None:
        tier = self.tiers[i]
        started = time.perf_counter()
        variant = self._guarded(tier, lambda: tier.get(key, fingerprint), key)
        if variant is not None and i > 0:
            self._metrics.tier(tier.name, "load_seconds", time.perf_counter() - started)
            self._metrics.tier(tier.name, "bytes_loaded", variant.num_bytes)
        return variant

    def _load_lazy(self, i: int, key: EntryKey, fingerprint: str) -> KVVariant | None:
        """Tier ``i``'s entry with only its header read, when the tier reads layers on
        demand (disk); a whole read otherwise."""
        tier = self.tiers[i]
        open_lazy = getattr(tier, "open_lazy", None)
        if i == 0 or open_lazy is None or time.monotonic() < self._whole_until.get(tier.name, 0):
            return self._load(i, key, fingerprint)
        started = time.perf_counter()
        opened = self._guarded(tier, lambda: open_lazy(key, fingerprint), key)
        if opened is None:
            return None
        self._metrics.tier(tier.name, "load_seconds", time.perf_counter() - started)
        header, layers = opened
        with self._lock:
            reuse = self._adopted_reuse(key, codec.reuse_of(header))
        events = self._lazy_events(i, key, fingerprint)
        return LazyKVVariant.from_header(header, reuse, layers, tier.name, events)

    def _lazy_events(self, i: int, key: EntryKey, fingerprint: str) -> LazyEvents:
        """Count a lazy variant's layer reads, promote it when whole, drop it if a layer fails."""
        tier = self.tiers[i]

        def read(seconds: float, num_bytes: int) -> None:
            self._metrics.tier(tier.name, "load_seconds", seconds)
            self._metrics.tier(tier.name, "bytes_loaded", num_bytes)

        def complete(variant: KVVariant) -> None:
            with self._lock:
                self._promote(i, key, fingerprint, variant)

        def failed(error: CorruptEntryError) -> None:
            with contextlib.suppress(OSError):  # dropped: the engine's rerun misses it
                tier.remove(key)
            if isinstance(error, LayerReadError):  # the disk failed, the entry may be sound
                self._io_error(tier, error.cause)
                self._whole_until[tier.name] = time.monotonic() + WHOLE_AFTER_IO_ERROR_S
                self._drop_unless_held(key)
            else:
                self._corrupt(tier, error, key)

        return LazyEvents(read, complete, failed)

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
                        if key in self.tiers[0]:  # a newer put landed while it was read
                            continue
                        self._touch(key, fingerprint, variant, count=False)
                        if self._copy_up(key, fingerprint, self._adopt(key, variant)):
                            self._metrics.tier(self.tiers[i].name, "prefetched")
                            top.add(key)
                            moved += 1
        return moved

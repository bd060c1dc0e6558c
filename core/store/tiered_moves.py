"""How the tiered store moves entries between tiers: insert, promote, demote.

A new variant goes to the fastest tier it fits in.  A hit below is copied up (promotion) and
the lower copy stays; a tier that must make room asks its policy for a victim, which moves
one tier down unless a lower tier already holds a copy (RAGCache §5.1: swap out only once,
multi-level eviction); leaving the last tier drops it for good and tells the drop listeners,
unless a faster tier still holds a copy promoted from below.
Write-through copies a new variant to every lower tier (RAG-DCache §III); past the store's
cap on the KV bytes queued write-throughs hold, one is skipped (counted), and its entry moves
down when evicted, as when no write-through ran.  A put replaces
an older variant under the same key (approximate KV, say, now computed exactly) in every
tier: write-through rewrites a lower copy that differs, and, where none ran, the put variant
drops such a copy when it is evicted and moves down in its place.  A failing tier is
counted (``errors``) and skipped, never a failed request; so is any failure moving an
evicted entry down (a MemoryError encoding it, a bug): the entry is not the caller's, and it
already left the tier evicting it, so it goes on down or is dropped for good.  A hit copied
up that the fastest tier fails to take (a MemoryError moving it to the device, a bug) is
counted the same way and served from its lower copy.  A
write-through a shared tier (Redis) skipped while down is remembered
(:class:`~chunkcache.core.store.backfill.PendingWrites`) and made once the tier answers again,
from the local tier that still holds the entry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from chunkcache.core.kv_store import KVVariant
from chunkcache.core.store import codec
from chunkcache.core.store.backfill import PendingWrites
from chunkcache.core.store.codec import EntryKey
from chunkcache.core.store.tier import Evicted, Loader, Tier, Victim
from chunkcache.core.store.tiered_drops import TieredDrops


class TieredMoves(TieredDrops):
    """The moving part of :class:`~chunkcache.core.store.tiered.TieredKVStore`."""

    _pending: dict[int, PendingWrites]  # shared tier index -> writes it missed while down
    _backfill_queued: set[int]
    _closed: bool
    _submit: Callable[..., Future[Any]]
    _backlog_bytes: int

    def _write_through(self, key: EntryKey, fingerprint: str, variant: KVVariant, put: int) -> None:
        """Copy the variant of put number ``put`` to every lower tier; once every one holds
        it, an eviction need not check their copies (:meth:`_demote_newer`).  Its bytes
        leave the write-through backlog then, whatever happened."""
        try:
            held = [
                self._write_down(i, key, fingerprint, variant) for i in range(1, len(self.tiers))
            ]
        finally:
            with self._lock:
                self._backlog_bytes -= variant.num_bytes
        with self._lock:
            if all(held) and self._newer.get(key) == put:
                del self._newer[key]

    def _write_down(self, i: int, key: EntryKey, fingerprint: str, variant: KVVariant) -> bool:
        """Write ``variant`` to lower tier ``i`` unless it holds the same variant already (an
        older one under the same key is replaced); whether tier ``i`` holds it now.  The store
        lock is held only while a tier makes room: encoding and fsyncing happen unlocked, so
        requests are not held up."""
        tier = self.tiers[i]
        if self._holds_same(tier, key, fingerprint, variant):
            return True
        if getattr(tier, "self_evicting", False):  # needs no policy: no lock either
            placed = tier.put(key, fingerprint, variant, *self._callbacks(i, key))
            if not placed and i in self._pending and not getattr(tier, "up", True):
                self._skipped(i, key, fingerprint)
            return placed
        prepare = getattr(tier, "prepare", None)
        if prepare is None:
            with self._lock:
                return self._insert(i, key, fingerprint, variant, fall_through=False) == i
        try:
            prepared = prepare(key, fingerprint, variant)
        except OSError as error:
            self._io_error(tier, error)
            return False
        if prepared is None:  # can never fit
            return False
        with self._lock:
            try:
                committed: bool = tier.commit(prepared, *self._callbacks(i, key))  # type: ignore[attr-defined]
            except OSError as error:
                self._io_error(tier, error)
                return False
            if committed:
                self.policies[i].touched(key, self._stats_of(key))
            return committed

    def _holds_same(self, tier: Tier, key: EntryKey, fingerprint: str, variant: KVVariant) -> bool:
        """Whether ``tier`` holds ``key`` as the same variant: alike in exactness and
        Cache-Craft metadata (the KV of two such is interchangeable: same tokens, positions,
        context and model).  Read from the header alone where the tier can (disk)."""
        if key not in tier:
            return False
        open_lazy = getattr(tier, "open_lazy", None)
        if open_lazy is None:
            held = self._guarded(tier, functools.partial(tier.get, key, fingerprint))
            return held is not None and (held.exact, held.meta) == (variant.exact, variant.meta)
        opened = self._guarded(tier, functools.partial(open_lazy, key, fingerprint))
        if opened is None:
            return False
        header, layers = opened
        layers.close()
        return (bool(header["exact"]), codec.meta_of(header)) == (variant.exact, variant.meta)

    def _skipped(self, i: int, key: EntryKey, fingerprint: str) -> None:
        """Shared tier ``i`` was down for the write of ``key``: write it once it is back."""
        with self._lock:
            self._pending[i].add(key, fingerprint)
        if getattr(self.tiers[i], "up", True):  # came back before ``key`` was remembered
            self._queue_backfill(i)

    def _queue_backfill(self, i: int) -> None:
        """Shared tier ``i`` answers again: backfill it on the background thread (once)."""
        with self._lock:  # submitted under the lock: close() cannot get in and run it inline
            if self._closed or i in self._backfill_queued or not self._pending[i]:
                return
            self._backfill_queued.add(i)
            self._submit(self._backfill, i)

    def _backfill(self, i: int) -> int:
        """Write to shared tier ``i`` the entries it missed while down that a local tier still
        holds, oldest first, until it fails again; the number written."""
        tier, written = self.tiers[i], 0
        with self._lock:
            self._backfill_queued.discard(i)
            missed = self._pending[i].oldest_first()
        for key, fingerprint in missed:
            variant = self._local_copy(key, fingerprint)  # None: evicted locally meanwhile
            if (
                variant is not None
                and not self._holds_same(tier, key, fingerprint, variant)  # written meanwhile
                and tier.put(key, fingerprint, variant, *self._callbacks(i, key))
            ):
                self._metrics.tier(tier.name, "backfilled")
                written += 1
            if not getattr(tier, "up", True):  # down again: the rest waits for the next time
                break
            with self._lock:
                self._pending[i].discard(key)
        return written

    def _local_copy(self, key: EntryKey, fingerprint: str) -> KVVariant | None:
        """``key``'s variant from the fastest local tier holding it, read whole.  Tiers are
        asked fastest first, each under the lock (an entry moves down under it, never seen
        halfway), so one evicted from a tier as it is read is found in the next."""
        for tier in self.tiers:
            if getattr(tier, "self_evicting", False):
                continue
            with self._lock:
                held = key in tier
            read = functools.partial(tier.get, key, fingerprint)
            if held and (variant := self._guarded(tier, read, key)) is not None:
                return variant
        return None

    def _promote(self, i: int, key: EntryKey, fingerprint: str, variant: KVVariant) -> KVVariant:
        """Copy up to the fastest tier; the lower copy stays (swap out only once).  A copy
        the fastest tier took meanwhile (a newer put, read unlocked) is kept."""
        if key in self.tiers[0]:
            return variant
        if self._copy_up(key, fingerprint, variant):
            self._metrics.tier(self.tiers[i].name, "promotions")
            return self.tiers[0].get(key, fingerprint) or variant
        return variant

    def _copy_up(self, key: EntryKey, fingerprint: str, variant: KVVariant) -> bool:
        """Whether the fastest tier took a copy of a variant found below.  Its failing is
        counted, never raised: the hit is sound and served from below, and the caller (a
        lookup, a lazy read mid-prefill, a prefetch) asked for KV, not for a move."""
        try:
            return self._insert(0, key, fingerprint, variant, fall_through=False) == 0
        except Exception as error:  # a MemoryError moving it to the device, a bug
            self._move_error(self.tiers[0], error, "served from below")
            return False

    def _insert(
        self,
        i: int,
        key: EntryKey,
        fingerprint: str,
        variant: KVVariant,
        fall_through: bool = True,
        moving: bool = False,
    ) -> int | None:
        """Put into tier ``i`` (or the first lower tier it fits in); the tier it landed in.
        A tier failing with OSError is passed over; so is one failing in any way to take an
        entry ``moving`` down (no caller's: its error is the store's)."""
        for j in range(i, len(self.tiers) if fall_through else i + 1):
            try:
                placed = self.tiers[j].put(key, fingerprint, variant, *self._callbacks(j, key))
            except OSError as error:  # full or failing disk: try the next tier
                self._io_error(self.tiers[j], error)
                continue
            except Exception as error:
                if not moving:
                    raise  # the caller's variant: its error
                self._move_error(self.tiers[j], error, "passed over")
                continue
            if placed:
                self.policies[j].touched(key, self._stats_of(key))
                return j
        return None

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
        (swap out only once); else it is gone for good, unless a faster tier still holds the
        copy promoted from here (that copy moves down when that tier evicts it).

        Called while tier ``i`` makes room for another entry: a failure here fails no
        caller; the entry is dropped unless another tier holds it."""
        self._metrics.tier(self.tiers[i].name, "evictions")
        self.policies[i].evicted(key, self._stats_of(key))
        try:
            self._demote(i, key, loader)
        except Exception as error:  # reading it (a MemoryError decoding), a bug
            self._move_error(self.tiers[i], error, "dropped")
            self._drop_unless_held(key, i)
        except BaseException:  # Ctrl-C is the caller's, but the entry must not linger
            self._drop_unless_held(key, i)
            raise

    def _demote(self, i: int, key: EntryKey, loader: Loader) -> None:
        """:meth:`_evicted`'s move down (or drop)."""
        lower = self.tiers[i + 1 :]
        above = any(key in tier for tier in self.tiers[:i])
        if lower and key in self._newer and not above:  # above, the put one may still be
            self._demote_newer(i, key, loader)
            return
        if any(key in tier for tier in lower):
            return
        loaded = loader() if lower else None
        if loaded is not None and self._insert(i + 1, key, *loaded, moving=True) is not None:
            self._metrics.tier(self.tiers[i].name, "demotions")
        elif not above:
            self._dropped(key)

    def _demote_newer(self, i: int, key: EntryKey, loader: Loader) -> None:
        """Tier ``i`` evicts a variant put over copies below that were not replaced yet (no
        write-through, or it failed): write it down in their place, then drop the older
        copies it did not overwrite.  If it cannot be written (a full disk), the older
        copies stay: a stale approximate KV beats none."""
        del self._newer[key]
        loaded = loader()
        below = range(i + 1, len(self.tiers))
        if loaded is None:  # unreadable: what is below stays as it is
            if not any(key in self.tiers[j] for j in below):
                self._dropped(key)
            return
        fingerprint, variant = loaded
        older = [
            j
            for j in below
            if key in self.tiers[j] and not self._holds_same(self.tiers[j], key, *loaded)
        ]
        # a tier below holds this variant already: swap out only once
        same_below = any(key in self.tiers[j] for j in below if j not in older)
        placed = None if same_below else self._insert(i + 1, key, fingerprint, variant, moving=True)
        if placed is not None:
            self._metrics.tier(self.tiers[i].name, "demotions")
        elif not same_below:
            if not any(key in self.tiers[j] for j in below):
                self._dropped(key)
            return
        for j in older:
            if j != placed:  # the tier it landed in replaced its copy
                try:
                    self.tiers[j].remove(key)
                except OSError as error:
                    self._io_error(self.tiers[j], error)

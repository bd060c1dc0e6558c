"""How the tiered store forgets entries and counts failures: an entry leaving the last tier
that holds it (evicted, found corrupt, a put that placed nowhere) has its statistics forgotten
and the drop listeners told (ChunkCache's prefix tree follows them); a failing tier is counted
in its ``errors`` and logged once per kind, never a failed request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from chunkcache.core.kv_store import DropListeners
from chunkcache.core.store.codec import CorruptEntryError, EntryKey
from chunkcache.core.store.metrics import StoreMetrics
from chunkcache.core.store.tier import Tier
from chunkcache.core.store.tiered_stats import TieredStats

log = logging.getLogger("chunkcache.core.store.tiered")
T = TypeVar("T")


class TieredDrops(TieredStats):
    """The forgetting and failure-counting part of
    :class:`~chunkcache.core.store.tiered.TieredKVStore`."""

    drop_listeners: DropListeners
    _metrics: StoreMetrics
    _io_warned: set[str]
    _lock: threading.RLock
    # key -> number of its last put, while lower tiers may hold an older variant of it
    _newer: dict[EntryKey, int]

    def _drop_unless_held(self, key: EntryKey, evicting: int | None = None) -> None:
        """``key`` left a tier (evicted by tier ``evicting`` but not moved down, or found
        corrupt): dropped unless another tier holds it (the evicting tier may still list it
        until the eviction returns: disk)."""
        with self._lock:
            if not any(key in tier for j, tier in enumerate(self.tiers) if j != evicting):
                self._dropped(key)

    def _not_placed(self, key: EntryKey, known: bool) -> None:
        """A put of ``key`` failed, or fit in no tier: ``key`` is forgotten unless a tier
        holds an older variant.  The listeners hear of it only if the store ``known`` it
        before the put (an older variant left on the way); a new one never entered."""
        if any(key in tier for tier in self.tiers):
            return
        if known:
            self._dropped(key)
        else:
            self._newer.pop(key, None)
            self._forget_stats(key)

    def _dropped(self, key: EntryKey) -> None:
        """``key`` left the last tier holding it: forget it, tell the listeners."""
        self._newer.pop(key, None)
        stats = self._forget_stats(key)
        if stats is not None and stats.names is not None:
            self.drop_listeners.notify([stats.names])

    def _guarded(
        self, tier: Tier, read: Callable[[], T], looked_up: EntryKey | None = None
    ) -> T | None:
        """``read()`` from ``tier``; a corrupt entry (which the tier removes) or a failing
        tier is a miss.  A lookup names its key, ``looked_up``: the store then forgets a
        corrupt entry no other tier holds.  A read for a move does not: the entry it moves
        is in no tier until the move ends, and the move checks what is held itself."""
        try:
            return read()
        except CorruptEntryError as error:
            self._corrupt(tier, error, looked_up)
        except OSError as error:  # a failing disk is a miss, never a failed request
            self._io_error(tier, error)
        return None

    def _corrupt(self, tier: Tier, error: CorruptEntryError, key: EntryKey | None) -> None:
        """Count a corrupt entry ``tier`` dropped; with ``key``, drop it from the store too
        unless another tier holds it (its statistics, and ChunkCache's prefix-tree paths
        through it, would outlive every copy)."""
        log.warning("dropped a corrupt entry from the %s tier: %s", tier.name, error)
        self._metrics.tier(tier.name, "corrupt_dropped")
        if key is not None:
            self._drop_unless_held(key)

    def _io_error(self, tier: Tier, error: OSError) -> None:
        """Count an I/O failure of ``tier``; the first one is logged as a warning."""
        self._metrics.tier(tier.name, "errors")
        level = logging.DEBUG if tier.name in self._io_warned else logging.WARNING
        self._io_warned.add(tier.name)
        log.log(level, "the %s tier failed (%s): treated as a miss", tier.name, error)

    def _move_error(self, tier: Tier, error: Exception, outcome: str) -> None:
        """Count ``tier`` failing to move an entry (an evicted one down, a hit up) other than
        by I/O; the first of each kind of error is logged as a warning, with its traceback
        (it may be a bug)."""
        self._metrics.tier(tier.name, "errors")
        kind = f"{tier.name}/{type(error).__name__}"
        first = kind not in self._io_warned
        self._io_warned.add(kind)
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "the %s tier failed to move an entry between tiers (%s: %s): %s",
            tier.name,
            type(error).__name__,
            error,
            outcome,
            exc_info=error if first else None,
        )

"""The writes a shared tier (Redis) missed while it was down, to make once it is back.

A failing shared tier is a miss, never a failed request, so a write-through to it while it
is down is skipped.  The tiered store remembers the skipped keys here, at most ``limit``
of them (the oldest are forgotten first), and when the tier answers again it writes those
still held by a local tier, on its background thread
(:meth:`~chunkcache.core.store.tiered_moves.TieredMoves._backfill`); entries evicted
locally meanwhile are forgotten.
"""

from __future__ import annotations

from collections import OrderedDict

from chunkcache.core.store.codec import EntryKey

BACKFILL_LIMIT = 10_000  # skipped writes remembered per shared tier


class PendingWrites:
    """Keys (with their fingerprints) whose write to a shared tier was skipped, oldest first.

    Not thread-safe: the store calls it under its lock.

    >>> pending = PendingWrites(limit=2)
    >>> for name in "abc":
    ...     pending.add(EntryKey("ns", name, "ctx"), "fp")
    >>> [key.segment for key, _ in pending.oldest_first()], pending.num_forgotten
    (['b', 'c'], 1)
    """

    def __init__(self, limit: int = BACKFILL_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.num_forgotten = 0  # dropped past the limit, never written
        self._keys: OrderedDict[EntryKey, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: EntryKey) -> bool:
        return key in self._keys

    def add(self, key: EntryKey, fingerprint: str) -> None:
        """Remember ``key`` as the newest; past the limit the oldest is forgotten."""
        self._keys[key] = fingerprint
        self._keys.move_to_end(key)
        while len(self._keys) > self.limit:
            self._keys.popitem(last=False)
            self.num_forgotten += 1

    def discard(self, key: EntryKey) -> None:
        """Forget ``key`` (written, or no local tier holds it any more)."""
        self._keys.pop(key, None)

    def oldest_first(self) -> list[tuple[EntryKey, str]]:
        """A copy of every ``(key, fingerprint)``, the oldest first."""
        return list(self._keys.items())

"""The tier contract, and the memory tier (host RAM, or a CUDA device).

A tier holds entries by :class:`EntryKey` within ``capacity_bytes``.  The tiered store
decides what to evict (a policy over its entry statistics); the tier makes room under its own
lock, so a tier shared by several processes (disk) can keep its capacity with entries the
store never saw.  Evicting hands the store the key and a loader for the variant, so the
store can demote it to the next tier, or skip the copy when a lower tier already has one
(RAGCache §5.1, swap out only once).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Protocol

import torch

from chunkcache.core.kv_store import KVVariant
from chunkcache.core.store.codec import EntryKey

Victim = Callable[[list[EntryKey]], EntryKey]
Loader = Callable[[], tuple[str, KVVariant] | None]  # (fingerprint, variant)
Evicted = Callable[[EntryKey, Loader], None]


class Tier(Protocol):
    """What the tiered store needs from one tier."""

    name: str
    capacity_bytes: int

    @property
    def num_bytes(self) -> int: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: EntryKey) -> bool: ...

    def segment_keys(self, namespace: str, segment: str) -> list[EntryKey]:
        """Keys of every stored variant of one segment."""
        ...

    def get(self, key: EntryKey, fingerprint: str) -> KVVariant | None:
        """The variant, or None if absent; raises ``CorruptEntryError`` if it fails checks."""
        ...

    def put(
        self, key: EntryKey, fingerprint: str, variant: KVVariant, victim: Victim, evicted: Evicted
    ) -> bool:
        """Store ``variant``, first evicting ``victim(keys)`` while it does not fit (each one
        reported to ``evicted``); False if it can never fit."""
        ...

    def remove(self, key: EntryKey) -> None: ...


class MemoryTier:
    """Variants in process memory on ``device`` (``cpu`` for the host tier)."""

    def __init__(self, name: str, capacity_bytes: int, device: str | torch.device = "cpu") -> None:
        if capacity_bytes < 1:
            raise ValueError(f"{name}: capacity_bytes must be positive")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.device = torch.device(device)
        self._entries: dict[EntryKey, KVVariant] = {}
        self._fingerprints: dict[EntryKey, str] = {}
        self._by_segment: dict[tuple[str, str], set[EntryKey]] = {}
        self._bytes = 0
        self._lock = threading.RLock()

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: EntryKey) -> bool:
        return key in self._entries

    def entry_keys(self) -> list[EntryKey]:
        with self._lock:
            return list(self._entries)

    def segment_keys(self, namespace: str, segment: str) -> list[EntryKey]:
        with self._lock:
            return list(self._by_segment.get((namespace, segment), ()))

    def get(self, key: EntryKey, fingerprint: str) -> KVVariant | None:
        return self._entries.get(key)

    def put(
        self, key: EntryKey, fingerprint: str, variant: KVVariant, victim: Victim, evicted: Evicted
    ) -> bool:
        if variant.num_bytes > self.capacity_bytes:
            return False
        variant = self._on_device(variant)
        with self._lock:
            # an older variant under ``key`` is replaced last: a put interrupted while making
            # room (Ctrl-C in a demotion) leaves it held, not gone without the store knowing
            old = self._entries.get(key)
            replaced = old.num_bytes if old is not None else 0
            while self._bytes - replaced + variant.num_bytes > self.capacity_bytes:
                out = victim([k for k in self._entries if k != key])
                gone = (self._fingerprints[out], self._entries[out])
                self.remove(out)
                evicted(out, functools.partial(_same, gone))
            self.remove(key)
            self._entries[key] = variant
            self._fingerprints[key] = fingerprint
            self._by_segment.setdefault(key.segment_key, set()).add(key)
            self._bytes += variant.num_bytes
        return True

    def remove(self, key: EntryKey) -> None:
        with self._lock:
            variant = self._entries.pop(key, None)
            if variant is None:
                return
            self._bytes -= variant.num_bytes
            del self._fingerprints[key]
            keys = self._by_segment[key.segment_key]
            keys.discard(key)
            if not keys:
                del self._by_segment[key.segment_key]

    def _on_device(self, variant: KVVariant) -> KVVariant:
        if variant.k.device == self.device:
            return variant
        # the reuse counter is shared: a reuse counted on any copy counts on all
        return variant.with_tensors(variant.k.to(self.device), variant.v.to(self.device))


def _same(entry: tuple[str, KVVariant]) -> tuple[str, KVVariant] | None:
    return entry

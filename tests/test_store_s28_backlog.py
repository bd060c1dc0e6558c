"""Write-throughs waiting for a busy lower tier hold at most a cap of KV (s28 leak probe).

The store's background queue was unbounded and each queued write-through holds its
variant's KV: with a slow disk, 300 tiny requests left ~480 jobs queued; with a real model
(~6 MB a 256-token chunk) such a backlog holds GBs.  Past the cap a write-through is
skipped and counted; the entry still goes down when the fastest tier evicts it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from test_store_support import FP, make_variant, same_kv

from chunkcache.core.kv_store import KVVariant
from chunkcache.core.store import MemoryTier, TieredKVStore, tiered
from chunkcache.core.store.codec import EntryKey, entry_key
from chunkcache.core.store.settings import StoreSettings
from chunkcache.core.store.tier import Evicted, Victim

SIZE = make_variant("x").num_bytes
Prepared = tuple[EntryKey, str, KVVariant]


class BlockingTier(MemoryTier):
    """A lower tier whose write-throughs wait until ``go`` is set (a disk busy with other
    work): like the disk tier, the slow part (:meth:`prepare`) runs without the store lock."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__("slow", capacity_bytes)
        self.go = threading.Event()
        self.started = threading.Event()

    def prepare(self, key: EntryKey, fingerprint: str, variant: KVVariant) -> Prepared:
        self.started.set()
        assert self.go.wait(timeout=30)
        return key, fingerprint, variant

    def commit(self, prepared: Prepared, victim: Victim, evicted: Evicted) -> bool:
        return self.put(*prepared, victim, evicted)


@pytest.fixture
def slow() -> Iterator[BlockingTier]:
    tier = BlockingTier(100 * SIZE)
    yield tier
    tier.go.set()  # never leave the store's thread waiting


def store_over(slow: BlockingTier, host_entries: int, backlog: int) -> TieredKVStore:
    host = MemoryTier("host", host_entries * SIZE)
    return TieredKVStore([host, slow], write_through=True, write_through_backlog_bytes=backlog)


def test_write_throughs_past_the_cap_are_skipped_and_counted(slow: BlockingTier) -> None:
    store = store_over(slow, host_entries=20, backlog=3 * SIZE)
    for i in range(10):
        store.put(FP, make_variant(f"s{i}", seed=i))
    assert slow.started.wait(timeout=30)
    assert store.metrics()["write_through_skipped"] == 7  # three held, the first running
    slow.go.set()
    store.flush()
    assert len(slow) == 3
    store.put(FP, make_variant("after", seed=99))  # the backlog was given back
    store.flush()
    assert len(slow) == 4 and store.metrics()["write_through_skipped"] == 7
    store.close()


def test_a_skipped_write_through_is_written_down_when_evicted(slow: BlockingTier) -> None:
    store = store_over(slow, host_entries=10, backlog=2 * SIZE)
    first = [make_variant(f"s{i}", seed=i) for i in range(10)]
    for variant in first:
        store.put(FP, variant)
    slow.go.set()
    store.flush()
    assert store.metrics()["write_through_skipped"] == 8
    for i in range(10):  # evict every first variant from the host tier
        store.put(FP, make_variant(f"t{i}", seed=100 + i))
    store.flush()
    for variant in first:
        key = entry_key(FP, variant.segment_id, variant.context)
        assert same_kv(slow.get(key, FP), variant)
    store.close()


def test_one_variant_larger_than_the_cap_is_written_through_alone(slow: BlockingTier) -> None:
    store = store_over(slow, host_entries=20, backlog=1)
    slow.go.set()
    store.put(FP, make_variant("big"))
    store.flush()
    assert len(slow) == 1 and store.metrics()["write_through_skipped"] == 0
    store.close()


def test_the_cap_has_a_default_and_a_setting() -> None:
    default = tiered.WRITE_THROUGH_BACKLOG_BYTES
    assert default == 256 * 2**20
    assert TieredKVStore([MemoryTier("host", SIZE)]).write_through_backlog_bytes == default
    assert StoreSettings.model_fields["write_through_backlog_bytes"].default == default
    settings = StoreSettings(device_bytes=0, disk_bytes=0, write_through_backlog_bytes=1234)
    assert TieredKVStore.from_settings(settings).write_through_backlog_bytes == 1234

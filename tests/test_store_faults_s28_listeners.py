"""A drop listener that raises: every other listener still hears of every eviction, the
store stays consistent and the put that evicted goes on (the error is logged); an interrupt
is raised once every listener was told."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from test_store_support import FP, make_variant

from chunkcache.core.kv_store import KVStore, MemoryKVStore
from chunkcache.core.store import MemoryTier, TieredKVStore
from chunkcache.core.store.codec import entry_key

SIZE = make_variant("x").num_bytes
Names = tuple[str, str, str]


def raising(error: Callable[[], BaseException]) -> Callable[[str, str, str], None]:
    def listener(fingerprint: str, segment_id: str, context: str) -> None:
        raise error()

    return listener


def memory_store() -> MemoryKVStore:
    return MemoryKVStore(2 * SIZE)


def tiered_store() -> TieredKVStore:
    return TieredKVStore([MemoryTier("host", 2 * SIZE)])


def fill(store: KVStore) -> None:
    """Two small variants: the store is full."""
    store.put(FP, make_variant("a"))
    store.put(FP, make_variant("b"))


@pytest.mark.parametrize("make", [memory_store, tiered_store])
def test_a_failing_listener_neither_silences_the_others_nor_fails_the_put(
    make: Callable[[], MemoryKVStore | TieredKVStore], caplog: pytest.LogCaptureFixture
) -> None:
    store = make()
    heard: list[Names] = []
    store.drop_listeners.append(raising(lambda: RuntimeError("a bug in a listener")))
    store.drop_listeners.append(lambda *names: heard.append(names))
    fill(store)
    big = make_variant("c", num_tokens=8)
    with caplog.at_level(logging.DEBUG):
        store.put(FP, big)
        store.put(FP, make_variant("d"))  # evicts c
    assert heard == [(FP, "a", "root"), (FP, "b", "root"), (FP, "c", "root")]
    assert store.exact(FP, "d", "root") is not None
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "listener" in warned[0].getMessage()
    assert warned[0].exc_info is not None  # a bug: its traceback, once
    assert store.drop_listeners.num_errors == 3
    if isinstance(store, MemoryKVStore):
        assert store.num_bytes == sum(v.num_bytes for v in store._entries.values())
        assert set(store._by_segment) == {(FP, "d")}


def test_an_interrupt_in_a_listener_reaches_the_caller_after_every_listener_heard() -> None:
    store = memory_store()
    heard: list[Names] = []
    store.drop_listeners.append(raising(KeyboardInterrupt))
    store.drop_listeners.append(lambda *names: heard.append(names))
    fill(store)
    with pytest.raises(KeyboardInterrupt):
        store.put(FP, make_variant("c", num_tokens=8))
    assert heard == [(FP, "a", "root"), (FP, "b", "root")]
    assert store.exact(FP, "c", "root") is not None


def test_an_interrupt_in_a_tiered_listener_leaves_the_store_consistent() -> None:
    """Raised in the middle of making room: the entry already dropped is forgotten and heard
    of by every listener, the rest stay."""
    store = tiered_store()
    heard: list[Names] = []
    store.drop_listeners.append(raising(KeyboardInterrupt))
    store.drop_listeners.append(lambda *names: heard.append(names))
    fill(store)
    with pytest.raises(KeyboardInterrupt):
        store.put(FP, make_variant("c", num_tokens=8))
    assert heard == [(FP, "a", "root")]
    assert not store.contains_segment(FP, "a") and entry_key(FP, "a", "root") not in store.stats
    assert store.exact(FP, "b", "root") is not None

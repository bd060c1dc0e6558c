"""ChunkCache.arrange: count, dedupe, order and promote one request's chunks."""

from __future__ import annotations

import threading

import pytest

from chunkcache.core import cache as cache_module
from chunkcache.core.cache import Arrangement, ChunkCache, default_cache
from chunkcache.core.errors import InvalidConversationIdError
from chunkcache.core.ledger import ConversationLedger
from chunkcache.core.ordering import Ordering
from chunkcache.core.registry import ChunkRegistry


def test_first_request_keeps_the_set_and_matches_nothing() -> None:
    cache = ChunkCache()
    result = cache.arrange(["c", "a", "b"])
    assert isinstance(result, Arrangement)
    assert sorted(result.order) == ["a", "b", "c"]
    assert result.dropped == []
    assert result.seen == frozenset()
    assert result.prefix_length == 0
    assert cache.num_requests == 1


@pytest.mark.parametrize("ordering", ["tree", "frequency", "retriever"])
def test_prefix_length_grows_when_the_same_set_repeats(ordering: Ordering) -> None:
    cache = ChunkCache()  # promotion threshold 2
    lengths = [cache.arrange(["x", "y", "z"], ordering=ordering).prefix_length for _ in range(4)]
    # Request 2 brings every count to 2 and promotes the order; request 3 reuses it.
    assert lengths == [0, 0, 3, 3]


def test_tree_order_puts_a_cached_prefix_first() -> None:
    cache = ChunkCache()
    cache.arrange(["a", "b"])
    cache.arrange(["b", "a"])
    cached = cache.arrange(["a", "b"]).order
    result = cache.arrange(["new", "b", "a"])
    assert result.order[:2] == cached
    assert result.prefix_length == 2


def test_threshold_one_promotes_on_first_sight() -> None:
    cache = ChunkCache(promotion_threshold=1)
    assert cache.arrange(["a", "b"]).prefix_length == 0
    assert cache.arrange(["b", "a"]).prefix_length == 2


def test_duplicates_collapse() -> None:
    cache = ChunkCache()
    result = cache.arrange(["a", "b", "a", "b", "c"], ordering="retriever")
    assert result.order == ["a", "b", "c"]
    assert cache.access_table.count("a") == 1


def test_drop_dedupes_across_turns_of_one_conversation_only() -> None:
    cache = ChunkCache()
    first = cache.arrange(["C1", "C2", "C3"], conversation_id="conv", dedupe="drop")
    assert sorted(first.order) == ["C1", "C2", "C3"]
    second = cache.arrange(["C2", "C3", "C4"], conversation_id="conv", dedupe="drop")
    assert second.order == ["C4"]
    assert sorted(second.dropped) == ["C2", "C3"]
    assert second.seen == {"C1", "C2", "C3"}
    other = cache.arrange(["C2", "C3", "C4"], conversation_id="other", dedupe="drop")
    assert sorted(other.order) == ["C2", "C3", "C4"]
    assert other.dropped == []
    anonymous = cache.arrange(["C2", "C3"], dedupe="drop")  # no conversation: no dedupe
    assert sorted(anonymous.order) == ["C2", "C3"]


def test_dropped_chunks_still_count_as_retrieved() -> None:
    # CRAFT §4.2 counts every retrieved chunk; §4.3 only decides what is placed.
    cache = ChunkCache()
    cache.arrange(["C1"], conversation_id="conv", dedupe="drop")
    cache.arrange(["C1", "C2"], conversation_id="conv", dedupe="drop")
    assert cache.access_table.count("C1") == 2


def test_mark_reports_seen_and_keeps_everything() -> None:
    cache = ChunkCache()
    cache.arrange(["C1", "C2"], conversation_id="conv", dedupe="mark")
    result = cache.arrange(["C2", "C3"], conversation_id="conv", dedupe="mark")
    assert sorted(result.order) == ["C2", "C3"]
    assert result.dropped == []
    assert result.seen == {"C1", "C2"}


def test_off_ignores_the_ledger() -> None:
    cache = ChunkCache()
    cache.arrange(["C1"], conversation_id="conv", dedupe="off")
    result = cache.arrange(["C1"], conversation_id="conv", dedupe="drop")
    assert result.order == ["C1"]
    assert "conv" in cache.ledger


def test_bad_arguments() -> None:
    cache = ChunkCache()
    with pytest.raises(ValueError, match="dedupe"):
        cache.arrange(["a"], dedupe="remove")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ordering"):
        cache.arrange(["a"], ordering="random")  # type: ignore[arg-type]
    with pytest.raises(InvalidConversationIdError):
        cache.arrange(["a"], conversation_id="")
    with pytest.raises(InvalidConversationIdError):
        cache.arrange(["a"], conversation_id=["conv"])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        cache.arrange("abc")  # one str is not a list of ids
    assert cache.num_requests == 0
    assert len(cache.access_table) == 0


def test_empty_request() -> None:
    cache = ChunkCache()
    result = cache.arrange([], conversation_id="conv", dedupe="drop")
    assert result == Arrangement(order=[], dropped=[], seen=frozenset(), prefix_length=0)


def test_an_empty_ledger_and_registry_passed_in_are_used() -> None:
    # Both have a length, so `ledger or ConversationLedger()` would replace empty ones.
    ledger, registry = ConversationLedger(), ChunkRegistry()
    one = ChunkCache(ledger=ledger, registry=registry)
    two = ChunkCache(ledger=ledger, registry=registry)
    assert one.ledger is ledger and two.ledger is ledger
    assert one.registry is registry and two.registry is registry
    one.arrange(["C1"], conversation_id="conv", dedupe="drop")
    assert two.arrange(["C1", "C2"], conversation_id="conv", dedupe="drop").order == ["C2"]


def test_window_bounds_table_and_tree() -> None:
    cache = ChunkCache(window=3, promotion_threshold=1)
    for i in range(40):
        cache.arrange([f"c{i}", f"c{i + 1}", f"c{i + 2}"])
    assert cache.access_table.num_requests == 3
    assert len(cache.access_table) <= 3 * 3
    assert len(cache.prefix_tree) <= cache.prefix_tree.max_nodes == 16 * 3


def test_stats() -> None:
    cache = ChunkCache()
    cache.registry.register("C1", "text")
    cache.arrange(["C1", "C2"], conversation_id="conv")
    assert cache.stats() == {
        "requests": 1,
        "access_table_chunks": 2,
        "access_table_requests": 1,
        "prefix_tree_nodes": 0,
        "conversations": 1,
        "registered_chunks": 1,
        "registered_chars": 4,
    }


def test_concurrent_arrange_counts_every_request() -> None:
    cache = ChunkCache()
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        barrier.wait()
        try:
            for i in range(100):
                result = cache.arrange(
                    ["shared", f"c{i % 7}", f"t{t}"], conversation_id=f"conv-{t}", dedupe="drop"
                )
                assert len(result.order) == len(set(result.order))
        except BaseException as error:  # surfaced below: threads swallow exceptions
            errors.append(error)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert cache.num_requests == 800
    assert cache.access_table.count("shared") == 800
    assert sum(cache.access_table.count(f"c{k}") for k in range(7)) == 800
    for t in range(8):
        assert cache.ledger.seen(f"conv-{t}") == {"shared", f"t{t}"} | {f"c{k}" for k in range(7)}


def test_default_cache_is_a_singleton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_module, "_default_cache", None)  # race to create it
    found: list[ChunkCache] = []
    threads = [threading.Thread(target=lambda: found.append(default_cache())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(found) == 8
    assert all(cache is default_cache() for cache in found)
    assert isinstance(default_cache(), ChunkCache)
    assert default_cache() is not ChunkCache()

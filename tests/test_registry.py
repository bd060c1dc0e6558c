"""The chunk registry: chunk id -> text, bounded LRU, versioned, thread-safe."""

from __future__ import annotations

import threading

import pytest

from chunkcache.core.errors import InvalidChunkError
from chunkcache.core.registry import ChunkRegistry


def test_register_get_items() -> None:
    registry = ChunkRegistry()
    assert registry.register("a", "alpha") is True
    assert registry.register("b", "beta") is True
    assert registry.get("a") == "alpha"
    assert registry.get("missing") is None
    assert "a" in registry
    assert "missing" not in registry
    assert len(registry) == 2
    assert registry.num_chars == len("alpha") + len("beta")
    assert registry.items() == [("b", "beta"), ("a", "alpha")]  # get() made a the newest


def test_items_is_a_snapshot() -> None:
    registry = ChunkRegistry()
    registry.register("a", "alpha")
    snapshot = registry.items()
    registry.register("b", "beta")
    assert snapshot == [("a", "alpha")]


@pytest.mark.parametrize("kwargs", [{"max_chunks": 0}, {"max_chars": 0}, {"max_chunks": -5}])
def test_bounds_must_be_positive(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        ChunkRegistry(**kwargs)


def test_lru_by_count() -> None:
    registry = ChunkRegistry(max_chunks=2)
    registry.register("a", "1")
    registry.register("b", "2")
    assert registry.get("a") == "1"  # a is used: b is now the oldest
    registry.register("c", "3")
    assert "b" not in registry
    assert [cid for cid, _ in registry.items()] == ["a", "c"]
    registry.register("a", "1")  # re-registering refreshes a too
    registry.register("d", "4")
    assert [cid for cid, _ in registry.items()] == ["a", "d"]


def test_lru_by_chars() -> None:
    registry = ChunkRegistry(max_chars=10)
    registry.register("a", "aaaa")
    registry.register("b", "bbbb")
    registry.register("c", "cccc")  # 12 > 10: a goes
    assert [cid for cid, _ in registry.items()] == ["b", "c"]
    assert registry.num_chars == 8
    registry.register("d", "dddddddddd")  # exactly the budget: everything else goes
    assert registry.items() == [("d", "dddddddddd")]
    assert registry.num_chars == 10


def test_too_large_text_is_not_kept() -> None:
    registry = ChunkRegistry(max_chars=5)
    registry.register("small", "tiny")
    version = registry.version
    assert registry.register("big", "x" * 6) is False
    assert "big" not in registry
    assert registry.get("small") == "tiny"
    assert registry.num_chars == 4
    assert registry.version == version


def test_a_too_large_new_text_removes_the_stale_one() -> None:
    registry = ChunkRegistry(max_chars=5)
    registry.register("doc", "old")
    version = registry.version
    assert registry.register("doc", "new text too long") is False
    assert registry.get("doc") is None
    assert registry.num_chars == 0
    assert registry.version > version


def test_version_bumps_on_every_change_only() -> None:
    registry = ChunkRegistry(max_chunks=2)
    v0 = registry.version
    registry.register("a", "1")
    v1 = registry.version
    assert v1 > v0
    registry.register("a", "1")  # same text: nothing a matcher needs to rebuild for
    registry.get("a")
    registry.items()
    assert registry.version == v1
    registry.register("a", "one")  # new text under the same id
    v2 = registry.version
    assert v2 > v1
    assert registry.num_chars == 3
    registry.register("b", "2")
    v3 = registry.version
    assert v3 > v2
    registry.register("c", "3")  # adds c and evicts a
    assert registry.version >= v3 + 2


def test_bad_ids_and_texts() -> None:
    registry = ChunkRegistry()
    with pytest.raises(InvalidChunkError):
        registry.register("", "text")
    with pytest.raises(InvalidChunkError):
        registry.register("bad id", "text")
    with pytest.raises(InvalidChunkError):
        registry.register(None, "text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        registry.register("ok", b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        registry.register("ok", None)  # type: ignore[arg-type]
    assert len(registry) == 0
    assert registry.version == 0


def test_odd_unicode_text_round_trips() -> None:
    registry = ChunkRegistry()
    text = "\ud800 lone surrogate, \U0001f600, \u05e9\u05dc\u05d5\u05dd, a\u200bb"
    assert registry.register("odd", text)
    assert registry.get("odd") == text


def test_threads_keep_the_bounds_and_the_char_count() -> None:
    registry = ChunkRegistry(max_chunks=50, max_chars=2000)
    barrier = threading.Barrier(8)
    versions: list[list[int]] = [[] for _ in range(8)]

    def work(t: int) -> None:
        barrier.wait()
        for i in range(300):
            registry.register(f"t{t}-{i % 80}", "x" * (i % 37 + 1))
            registry.get(f"t{(t + 1) % 8}-{i % 80}")
            versions[t].append(registry.version)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    items = registry.items()
    assert len(items) == len(registry) <= 50
    assert registry.num_chars == sum(len(text) for _, text in items) <= 2000
    assert len({cid for cid, _ in items}) == len(items)
    for seen in versions:
        assert seen == sorted(seen)

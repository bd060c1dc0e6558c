"""ChunkCache's backend by name, and its prefix tree kept in step with the engine's store."""

from __future__ import annotations

import threading

import pytest
from test_store_support import FP, cache_on, make_variant, promoted

from chunkcache.core.backends import BackendSpec
from chunkcache.core.cache import ChunkCache
from chunkcache.core.kv_store import KVStore, MemoryKVStore
from chunkcache.core.store import MemoryTier, TieredKVStore

VARIANT_BYTES = make_variant("x").num_bytes


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "gpu"}, "unknown backend"),
        ({"backend": "http"}, "needs base_url"),
        ({"backend": "vllm", "base_url": "http://127.0.0.1:1"}, "needs model"),
        ({"backend": "local", "base_url": "http://127.0.0.1:1"}, "no base_url"),
        ({"base_url": "http://127.0.0.1:1"}, "need backend="),
    ],
)
def test_bad_backend_options_fail_when_the_cache_is_made(
    kwargs: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ChunkCache(**kwargs)  # type: ignore[arg-type]


def test_options_go_with_a_name_not_an_object() -> None:
    from fake_backend import FakeBackend

    with pytest.raises(ValueError, match="backend name"):
        ChunkCache(backend=FakeBackend(), base_url="http://127.0.0.1:1")


def test_a_named_backend_is_built_on_first_use_only() -> None:
    cache = ChunkCache(backend="http", base_url="http://127.0.0.1:1")
    assert cache.stats()["requests"] == 0
    cache.arrange(["a", "b"])  # the retriever side never builds the backend
    assert cache._backend is None
    assert cache._backend_spec == BackendSpec("http", "http://127.0.0.1:1")


def test_arranging_never_waits_for_a_backend_being_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Building the local backend loads a model for seconds; the retriever side (also an
    # async retriever on the event loop) must not wait for it.
    from fake_backend import FakeBackend

    building, release = threading.Event(), threading.Event()

    def slow_build(spec: BackendSpec) -> FakeBackend:
        building.set()
        assert release.wait(10)
        return FakeBackend()

    monkeypatch.setattr(BackendSpec, "build", slow_build)
    cache = ChunkCache(backend="http", base_url="http://127.0.0.1:1")
    builder = threading.Thread(target=lambda: cache.backend)
    builder.start()
    try:
        assert building.wait(10)
        arranged = threading.Thread(target=cache.arrange, args=(["a", "b"],))
        arranged.start()
        arranged.join(5)
        assert not arranged.is_alive()  # done while the backend is still being built
        assert cache.stats()["requests"] == 1
    finally:
        release.set()
        builder.join()
    assert isinstance(cache.backend, FakeBackend)


@pytest.mark.parametrize("tiered", [False, True])
def test_evicting_a_chunks_last_variant_removes_its_prefixes(tiered: bool) -> None:
    capacity = 2 * VARIANT_BYTES
    store: KVStore = (
        TieredKVStore([MemoryTier("host", capacity)]) if tiered else MemoryKVStore(capacity)
    )
    cache = cache_on(store)
    assert promoted(cache, ["a", "b"]) == 2
    store.put(FP, make_variant("a", "ctx-1"))
    store.put(FP, make_variant("a", "ctx-2"))  # capacity 2: the next put evicts ctx-1
    store.put(FP, make_variant("b", "ctx-1"))
    assert cache.prefix_tree.longest_prefix_length(["a", "b"]) == 2  # a still has ctx-2
    store.put(FP, make_variant("c", "ctx-1"))  # evicts a's last variant
    assert cache.prefix_tree.longest_prefix_length(["a", "b"]) == 0
    assert len(cache.prefix_tree) == 0  # b only sat below a


def test_replacing_a_variant_is_no_eviction() -> None:
    store = MemoryKVStore(4 * VARIANT_BYTES)
    cache = cache_on(store)
    assert promoted(cache, ["a"]) == 1
    store.put(FP, make_variant("a", "ctx-1", seed=1))
    store.put(FP, make_variant("a", "ctx-1", seed=2))
    assert cache.prefix_tree.longest_prefix_length(["a"]) == 1
    assert store.num_evictions == 0


def test_named_remote_backends_are_built_with_their_options() -> None:
    from chunkcache.core.http_backend import HttpBackend
    from chunkcache.integrations.vllm import VllmBackend

    http = ChunkCache(backend="http", base_url="http://127.0.0.1:1/v1", api_key="k").backend
    assert isinstance(http, HttpBackend) and http.base_url == "http://127.0.0.1:1"
    vllm = ChunkCache(backend="vllm", base_url="http://127.0.0.1:2", model="served-name").backend
    assert isinstance(vllm, VllmBackend)
    assert (vllm.base_url, vllm.model_name) == ("http://127.0.0.1:2", "served-name")

"""Review of the store backfill / contains_chunk and serve fit_window / server_root changes:
each test here failed before its fix."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from test_store_backfill import _FlakyShared
from test_store_support import FP, cache_on, make_variant, promoted, same_kv
from tiny_models import tiny_lm

from chunkcache.core.chunk_ids import chunk_key
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.errors import PromptTooLongError
from chunkcache.core.generation import GenerationRequest, SamplingParams
from chunkcache.core.http_backend import HttpBackend
from chunkcache.core.kv_store import KVVariant
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.prompting import generate
from chunkcache.core.segmenter import TextSegment
from chunkcache.core.serve import create_app
from chunkcache.core.serve.launcher import serve_app
from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore
from chunkcache.core.store.codec import EntryKey, entry_key
from chunkcache.core.urls import server_root

SIZE = make_variant("x").num_bytes


def _disk_entry_bytes(tmp_path: Path) -> int:
    disk = DiskTier(tmp_path / "probe", 10**6)
    TieredKVStore([disk]).put(FP, make_variant("probe"))
    return disk.num_bytes


def test_the_last_tier_evicting_a_copy_a_faster_tier_holds_drops_nothing(
    tmp_path: Path,
) -> None:
    """Write-through leaves a copy on disk; the disk evicting it while the host still holds
    the entry is no drop: its statistics stay and the prefix tree keeps the chunk."""
    disk = DiskTier(tmp_path / "kv", 2 * _disk_entry_bytes(tmp_path) + 10)
    store = TieredKVStore([MemoryTier("host", 10 * SIZE), disk], write_through=True)
    cache = cache_on(store)
    a = chunk_key("doc-a", (1,))
    assert promoted(cache, ["doc-a"]) == 1
    gone: list[tuple[str, str, str]] = []
    store.drop_listeners.append(lambda *names: gone.append(names))
    for segment_id in (a, "b", "c"):  # the disk holds two: it evicts a's copy
        store.put(FP, make_variant(segment_id))
        store.flush()
    key = entry_key(FP, a, "root")
    assert key not in disk and key in store.tiers[0]
    assert gone == [] and key in store.stats
    assert store.contains_chunk(FP, "doc-a")
    assert cache.prefix_tree.longest_prefix_length(["doc-a"]) == 1


def test_a_chunk_stays_while_its_segment_has_a_variant_this_store_never_touched(
    tmp_path: Path,
) -> None:
    """The disk holds a variant of the segment from an earlier run (or another process):
    ``contains_chunk`` knows only this store's entries, the listener also asks the tiers."""
    segment = chunk_key("doc-a", (1, 2))
    earlier = TieredKVStore([DiskTier(tmp_path / "kv", 10**6)])
    earlier.put(FP, make_variant(segment, "ctx-earlier"))
    earlier.close()
    big = make_variant("other", num_tokens=64).num_bytes
    disk = DiskTier(tmp_path / "kv", 2 * _disk_entry_bytes(tmp_path))
    store = TieredKVStore([MemoryTier("host", big + big // 2), disk])
    cache = cache_on(store)
    assert promoted(cache, ["doc-a"]) == 1
    # Too big for the disk: its eviction from the host is a drop.
    store.put(FP, make_variant(segment, "ctx-now", num_tokens=64))
    store.put(FP, make_variant("other", num_tokens=64))
    assert not store.contains_chunk(FP, "doc-a")  # knows only what it stored itself
    assert store.contains_segment(FP, segment)  # the earlier run's variant
    assert cache.prefix_tree.longest_prefix_length(["doc-a"]) == 1


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://host:8000/v1?key=1", "query"),  # /v1/models would land in the query
        ("http://host:8000/#top", "fragment"),
        ("http://user:secret@host:8000/v1", "credentials"),  # would replace the api_key
        ("http://ho st:8000", "whitespace"),
        ("http://host:99999", "port"),
    ],
)
def test_a_base_url_the_client_would_send_wrongly_is_refused(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as refused:
        server_root(url)
    assert "secret" not in str(refused.value)


@pytest.mark.parametrize(
    ("url", "root"),
    [
        ("http://[::1]:8000/v1", "http://[::1]:8000"),
        ("https://host:8443/v1/", "https://host:8443"),
        ("HTTPS://Host.Example/v1", "HTTPS://Host.Example"),
        (" http://127.0.0.1:8000/v1\n", "http://127.0.0.1:8000"),  # e.g. read from a file
    ],
)
def test_ipv6_ports_upper_case_and_surrounding_whitespace_are_fine(url: str, root: str) -> None:
    assert server_root(url) == root
    backend = HttpBackend(url, model="m")
    try:
        request = backend._client.build_request("GET", "/v1/models")
        assert str(request.url).lower() == f"{root}/v1/models".lower()
    finally:
        backend.close()


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


def _words(n: int) -> str:
    """``n`` words of the tiny vocabulary, one token each."""
    return " ".join(f"w{i % 120}" for i in range(n))


@pytest.mark.parametrize("fit_window", [True, False])
def test_the_http_backend_raises_prompt_too_long_as_the_local_one_does(
    lm: LoadedModel, fit_window: bool
) -> None:
    local = LocalBackend(ChunkEngine(lm))
    sampling = SamplingParams(max_tokens=8, fit_window=fit_window)
    request = GenerationRequest([TextSegment(_words(local.context_window))], sampling=sampling)
    with pytest.raises(PromptTooLongError):
        generate(local, request)
    with serve_app(create_app(local)) as url:
        http = HttpBackend(url)
        try:
            with pytest.raises(PromptTooLongError, match="context window of"):
                generate(http, request)
        finally:
            http.close()


class _EvictedOnRead(MemoryTier):
    """A host tier where ``on_get`` runs just before a read: another thread's put evicting
    the entry between the backfill's ``key in tier`` and its read."""

    on_get: Callable[[], None] | None = None

    def get(self, key: EntryKey, fingerprint: str) -> KVVariant | None:
        if self.on_get is not None:
            on_get, self.on_get = self.on_get, None
            on_get()
        return super().get(key, fingerprint)


def test_the_backfill_reads_an_entry_evicted_to_disk_as_it_was_read(tmp_path: Path) -> None:
    host, shared = _EvictedOnRead("host", SIZE), _FlakyShared()
    store = TieredKVStore([host, DiskTier(tmp_path / "kv", 10**6), shared], write_through=True)
    shared.up = False
    a = make_variant("a")
    store.put(FP, a)
    store.flush()
    host.on_get = lambda: store.put(FP, make_variant("b"))  # a moves down to the disk
    shared.back()
    store.flush()
    assert same_kv(shared.get(entry_key(FP, "a", "root"), FP), a)
    assert store.metrics()["tiers"]["shared"]["backfilled"] == 1


class _CloseWhenLetGo:
    """The store's lock, calling ``on_let_go`` once, the first time its holder lets go of it
    entirely after it was armed: ``close()`` on another thread getting in right there."""

    def __init__(self, on_let_go: Callable[[], None]) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._on_let_go = on_let_go
        self.armed = False

    def __enter__(self) -> None:
        self._lock.acquire()
        self._depth += 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        self._lock.release()
        if self._depth == 0 and self.armed:
            self.armed = False
            self._on_let_go()


def test_a_backfill_never_runs_inline_when_close_gets_in_while_it_is_queued() -> None:
    shared = _FlakyShared()
    store = TieredKVStore([MemoryTier("host", 4 * SIZE), shared], write_through=True)
    shared.up = False
    store.put(FP, make_variant("a"))
    store.flush()
    ran_on: list[int] = []
    backfill = store._backfill

    def recorded(i: int) -> int:
        ran_on.append(threading.get_ident())
        return backfill(i)

    store._backfill = recorded  # type: ignore[method-assign]
    lock = _CloseWhenLetGo(store.close)
    store._lock = lock  # type: ignore[assignment]
    lock.armed = True
    shared.back()  # a request thread's Redis call: the listener queues the backfill
    assert len(ran_on) == 1 and ran_on[0] != threading.get_ident()  # on the store's thread

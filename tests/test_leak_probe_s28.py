"""Probe s28: what a process running chunkcache for weeks accumulates outside Python's data
structures stays flat once warm.

Seeded mixed requests on a tiny random Llama (many conversations, chunks reused and new,
every recompute policy and ratio, greedy and seeded sampling, prompts too long for the
window) go through ``LocalBackend``, ``BatchingBackend`` and ``chunkcache serve`` in this
process reached by ``HttpBackend``, over tiered stores with small host, disk and Redis
capacities (each local eviction policy somewhere).  Their streams are read to the end,
closed after a piece, dropped unclosed after a piece, cancelled, or dropped unread, several
at once.  After a warm-up, a measured phase leaves OS threads, descriptors and memory maps as
they were, no temp files, the disk tier's files and Redis's keys within capacity, and
resident memory (after ``gc.collect()`` and ``malloc_trim``) within a generous bound.
Per-structure bounds are other probes' (``test_memory_probe_s27_*``, ``test_bounds_s27_*``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest
import torch
from test_store_support import FP, make_variant
from tiny_models import tiny_lm

from chunkcache.core.batching import BatchingBackend
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.errors import PromptTooLongError
from chunkcache.core.generation import POLICIES, GenerationChunk, GenerationRequest, SamplingParams
from chunkcache.core.http_backend import HttpBackend
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.segmenter import ChunkSegment, Segment, TextSegment
from chunkcache.core.serve import ServeSettings, create_app
from chunkcache.core.serve.heap_trim import _malloc_trim
from chunkcache.core.serve.launcher import serve_app
from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore
from chunkcache.core.store.redis_server import REDIS_SERVER, redis_server
from chunkcache.core.store.redis_tier import RedisTier

RSS_GROWTH_MB = 30.0  # generous: the store's statistics alone may grow ~10 MB before pruning
SETTLE_S = 20.0  # how long a closing socket or an ending thread may take to go
HOST_BYTES, DISK_BYTES, REDIS_BYTES = 60_000, 150_000, 150_000  # ~8, ~20, ~20 chunk entries
MODES = ("read", "read", "read", "close", "drop", "cancel", "unread")
REDIS_PREFIX = "chunkcache:v1"
# Thread pools that grow with the most requests ever run at once, up to a cap, and shrink
# when idle: anyio's worker threads (40 at most) and the event loop's default executor (at
# most 32); their count depends on timing, so they are held to their caps alone.
POOLS, POOLED_MAX = ("AnyIO worker thread", "asyncio_", "uvloop_"), 40 + 32
needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="needs Debian's redis-server")


class Stream(Protocol):
    """What every backend's stream has: pieces, and a thread-safe cancel."""

    def __next__(self) -> GenerationChunk: ...

    def cancel(self) -> None: ...

    def close(self) -> None: ...


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: two spin against each other on this shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp directory of this test's own (the machine's is shared with other jobs)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


# --- what the process holds ------------------------------------------------------------------


@dataclass(frozen=True)
class Census:
    """The process's OS-level holdings at one moment."""

    threads: int  # Python threads, but those of :data:`POOLS`
    pooled: int  # threads of :data:`POOLS`
    tasks: int  # OS threads (OpenMP's too), but those of :data:`POOLS`
    fds: int
    maps: int  # memory mappings
    rss_mb: float


def census() -> Census:
    """What the process holds now, after a full collection and the heap's free pages are
    handed back (glibc keeps them otherwise: that is not a leak)."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    with open("/proc/self/statm") as statm:
        rss_pages = int(statm.read().split()[1])
    with open("/proc/self/maps") as maps:
        num_maps = sum(1 for _ in maps)
    pooled = sum(t.name.startswith(POOLS) for t in threading.enumerate())
    return Census(
        threading.active_count() - pooled,
        pooled,
        len(os.listdir("/proc/self/task")) - pooled,
        len(os.listdir("/proc/self/fd")),
        num_maps,
        rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20,
    )


def open_files() -> list[str]:
    """What this process's descriptors point at (for a failure's message)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sorted(targets)


def eventually(done: Callable[[], bool]) -> bool:
    """Whether ``done()`` holds within :data:`SETTLE_S` (sockets close and threads end a
    moment after their request ends)."""
    deadline = time.monotonic() + SETTLE_S
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def steady() -> Census:
    """A census whose threads and descriptors held from one reading to the next."""
    readings = [census()]

    def same_twice() -> bool:
        readings.append(census())
        last, now = readings[-2:]
        return (last.threads, last.tasks, last.fds) == (now.threads, now.tasks, now.fds)

    eventually(same_twice)
    return readings[-1]


def assert_flat(warm: Census) -> None:
    """The census after the measured phase holds no more than after warm-up: as many threads
    (pools within their caps) and descriptors, memory maps but a few glibc arenas (one per
    thread at most), resident memory within :data:`RSS_GROWTH_MB`."""

    def flat() -> bool:
        now = census()
        return now.threads <= warm.threads and now.tasks <= warm.tasks and now.fds <= warm.fds

    eventually(flat)
    now = census()
    assert now.threads <= warm.threads, (warm, now, [t.name for t in threading.enumerate()])
    assert now.tasks <= warm.tasks, (warm, now)
    assert now.pooled <= POOLED_MAX, (warm, now)
    assert now.fds <= warm.fds, (warm, now, open_files())
    assert now.maps <= warm.maps + 2 * now.tasks, (warm, now)
    assert now.rss_mb - warm.rss_mb < RSS_GROWTH_MB, (warm, now)


# --- the workload ----------------------------------------------------------------------------


class Workload:
    """Seeded mixed requests over a pool of reused chunks, one in five with new chunks."""

    def __init__(self, seed: int, window: int) -> None:
        self.rng = random.Random(seed)
        self.window = window
        self.chunks = [(f"c{i}", self.words(self.rng.randint(6, 14))) for i in range(60)]
        self.num_requests = 0

    def words(self, n: int) -> str:
        return " ".join(f"w{self.rng.randrange(3, 120)}" for _ in range(n))

    def request(self) -> GenerationRequest:
        n, rng = self.num_requests, self.rng
        self.num_requests += 1
        fresh = [(f"new{n}-{j}", self.words(8)) for j in range(4)]
        segments: list[Segment] = [TextSegment(self.words(3) + " ")]
        for cid, text in rng.sample(fresh if n % 5 == 0 else self.chunks, rng.randint(1, 4)):
            segments += [ChunkSegment(cid, text), TextSegment(" ")]
        segments.append(TextSegment(self.words(rng.randint(1, 4))))
        too_long = n % 23 == 22  # no room for max_tokens in the window: PromptTooLongError
        sampling = SamplingParams(
            max_tokens=self.window if too_long else rng.randint(1, 8),
            temperature=rng.choice([0.0, 0.8]),
            seed=n,
        )
        return GenerationRequest(
            segments,
            policy=rng.choice(POLICIES),
            recompute_ratio=rng.choice([0.0, 0.15, 0.5, 1.0]),
            sampling=sampling,
            conversation_id=None if rng.random() < 0.3 else f"conv-{rng.randrange(80)}",
        )


def run_group(streams: Sequence[tuple[Stream, str]]) -> None:
    """Read several streams at once, a piece from each in turn, each as its ``mode`` says:
    to the end, closed or dropped unclosed after a piece, cancelled first, dropped unread."""
    active = []
    for stream, mode in streams:
        if mode == "cancel":
            stream.cancel()
        if mode != "unread":
            active.append((stream, mode))
    while active:
        for item in list(active):
            stream, mode = item
            try:
                next(stream)
            except (StopIteration, PromptTooLongError):
                active.remove(item)
                continue
            if mode in ("close", "drop"):
                if mode == "close":
                    stream.close()
                active.remove(item)


def drive(start: Callable[[GenerationRequest], Stream], work: Workload, n: int) -> None:
    """``n`` requests in groups of 1-5 read at once, each stream in a random mode."""
    rng = work.rng
    while n > 0:
        size = min(n, rng.randint(1, 5))
        run_group([(start(work.request()), rng.choice(MODES)) for _ in range(size)])
        n -= size


# --- the tiers ---------------------------------------------------------------------------------


def tiered(
    folder: Path, policy: str, redis_url: str | None = None, write_through: bool = False
) -> TieredKVStore:
    """Small host and disk tiers (and Redis): every few requests evict down and out."""
    tiers: list[Any] = [MemoryTier("host", HOST_BYTES), DiskTier(folder / "kv", DISK_BYTES)]
    if redis_url is not None:
        tiers.append(RedisTier(redis_url, REDIS_BYTES, timeout_s=5.0))
    return TieredKVStore(tiers, policy=policy, write_through=write_through)


def assert_disk_within_capacity(store: TieredKVStore) -> None:
    """Only the committed entries' two files (and the lock and epoch files) are left in the
    disk tier's directory, within its capacity: no temp file outlives its write."""
    store.flush()
    disk = next(tier for tier in store.tiers if isinstance(tier, DiskTier))
    files = [path for path in disk.root.rglob("*") if path.is_file()]
    entries = [path for path in files if path.parent != disk.root]
    assert not [path for path in entries if path.name.startswith(".tmp.")]
    assert len(entries) == 2 * len(disk)
    assert sum(path.stat().st_size for path in entries) <= disk.capacity_bytes
    assert sorted(path.name for path in files if path.parent == disk.root) == [".epoch", ".lock"]


def assert_redis_within_capacity(url: str) -> None:
    """Redis holds the tier's entries within its capacity, each entry's segment set, and
    the tier's four bookkeeping keys: nothing a dropped entry left behind."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        entries = client.hlen(f"{REDIS_PREFIX}:sizes")
        assert int(client.get(f"{REDIS_PREFIX}:bytes") or 0) <= REDIS_BYTES
        assert entries * min_blob_bytes() <= REDIS_BYTES
        assert client.dbsize() <= 2 * entries + 4
        assert all(key.startswith(REDIS_PREFIX.encode()) for key in client.scan_iter())
    finally:
        client.close()


def min_blob_bytes() -> int:
    """A lower bound on one entry's bytes: one token of the tiny model's K and V."""
    return 2 * 3 * 2 * 16 * 4  # K and V, 3 layers, 2 KV heads, head_dim 16, float32


# --- the probes --------------------------------------------------------------------------------


def warm_and_measure(
    start: Callable[[GenerationRequest], Stream],
    work: Workload,
    warm_up: int,
    measured: int,
    store: TieredKVStore,
    private_tmp: Path,
) -> None:
    """Warm up, take the census, run the measured phase, and hold it to the census.  The
    store's background writes are waited for first: one in flight holds a temp file open."""
    drive(start, work, warm_up)
    store.flush()
    warm = steady()
    drive(start, work, measured)
    store.flush()
    assert_flat(warm)
    assert os.listdir(private_tmp) == []


@pytest.mark.slow
@needs_redis
def test_local_backend_over_every_tier_holds_nothing_more_once_warm(
    lm: LoadedModel, tmp_path: Path, private_tmp: Path
) -> None:
    work = Workload(seed=28, window=lm.spec.context_window)
    with redis_server(tmp_path) as (url, _):
        store = tiered(tmp_path, "pgdsf", url, write_through=True)
        backend = LocalBackend(ChunkEngine(lm, store, layer_loading=True))
        warm_and_measure(backend.stream, work, 300, 600, store, private_tmp)
        assert_disk_within_capacity(store)
        assert_redis_within_capacity(url)
        tiers = store.metrics()["tiers"]
        assert tiers["disk"]["hits"] > 0 and tiers["redis"]["hits"] > 0  # all tiers in use
        assert tiers["redis"]["evictions"] > 0
        store.close()


@pytest.mark.slow
@needs_redis
def test_batching_backend_over_every_tier_holds_nothing_more_once_warm(
    lm: LoadedModel, tmp_path: Path, private_tmp: Path
) -> None:
    work = Workload(seed=29, window=lm.spec.context_window)
    with redis_server(tmp_path) as (url, _):
        store = tiered(tmp_path, "cachecraft", url)
        backend = BatchingBackend(ChunkEngine(lm, store), max_batch=4)
        try:
            warm_and_measure(backend.submit, work, 300, 600, store, private_tmp)
            assert_disk_within_capacity(store)
            assert_redis_within_capacity(url)
            counts = backend.metrics()
            assert (counts["waiting"], counts["running"]) == (0, 0)
            assert counts["cancelled_total"] > 0 and counts["failed_total"] > 0
            assert counts["batch_size_mean"] > 1
        finally:
            assert backend.shutdown(timeout_s=30)
            store.close()


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["local", "batching"])
def test_serve_over_http_holds_nothing_more_once_warm(
    lm: LoadedModel, tmp_path: Path, private_tmp: Path, engine: str
) -> None:
    work = Workload(seed=30, window=lm.spec.context_window)
    store = tiered(tmp_path, "lfu")
    served_engine = ChunkEngine(lm, store)
    served = LocalBackend(served_engine) if engine == "local" else BatchingBackend(served_engine)
    app = create_app(served, ServeSettings(), store=store)
    with serve_app(app) as url:
        http = HttpBackend(url)
        warm_and_measure(http.stream, work, 100, 200, store, private_tmp)
        runner = app.state.serve.runner
        assert eventually(lambda: runner.in_flight == 0)  # every request gave its place back
        assert_disk_within_capacity(store)
        http.close()


def batching_backend(lm: LoadedModel) -> tuple[BatchingBackend, threading.Thread]:
    """A batching backend and its scheduler's thread."""
    before = set(threading.enumerate())
    backend = BatchingBackend(ChunkEngine(lm))
    (thread,) = set(threading.enumerate()) - before
    return backend, thread


def test_a_dropped_batching_backend_stops_its_scheduler_and_lets_its_engine_go(
    lm: LoadedModel,
) -> None:
    """A backend dropped without ``shutdown()`` (a model swapped for another) kept its
    scheduler thread, and through it the engine with its model and KV, for good."""
    backend, thread = batching_backend(lm)
    run_group([(backend.submit(Workload(1, 512).request()), "read")])
    engine = weakref.ref(backend.engine)
    del backend
    gc.collect()
    thread.join(timeout=SETTLE_S)
    assert not thread.is_alive()
    gc.collect()
    assert engine() is None


def test_a_request_still_read_when_its_batching_backend_is_dropped_runs_to_its_end(
    lm: LoadedModel,
) -> None:
    backend, thread = batching_backend(lm)
    request = Workload(2, 512).request()
    request = GenerationRequest(request.segments, sampling=SamplingParams(max_tokens=6))
    alone = [piece.text for piece in backend.submit(request)]
    handle = backend.submit(request)
    del backend
    gc.collect()
    assert [piece.text for piece in handle] == alone
    thread.join(timeout=SETTLE_S)
    assert not thread.is_alive()


def test_the_disk_tier_leaves_no_folder_per_segment_it_ever_held(tmp_path: Path) -> None:
    """Every segment ever written kept its (empty) folder: a service meeting new chunks for
    weeks piles up one folder per chunk it ever stored on disk (an inode and a block each,
    beyond capacity), and every rescan after another process's write walks them all."""
    size = make_variant("x").num_bytes
    store = TieredKVStore([MemoryTier("host", size), DiskTier(tmp_path, 3 * size + 3000)])
    for i in range(200):
        store.put(FP, make_variant(f"segment-{i}", seed=i))
    disk = store.tiers[1]
    assert isinstance(disk, DiskTier)
    folders = [path for path in disk.root.rglob("*") if path.is_dir()]
    assert 0 < len(disk) <= 4
    # the layout folder, one per namespace, and at most two per entry held
    assert len(folders) <= 2 + 2 * len(disk), len(folders)

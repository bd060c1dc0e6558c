"""Disk tier persistence: reopen, checksums, fingerprint namespaces, SIGKILL, two writers."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_store_support import FP, make_variant, same_kv, tree_bytes

from chunkcache.core.craft import CraftMeta
from chunkcache.core.kv_store import KVVariant, ReuseCount
from chunkcache.core.store import DiskTier, TieredKVStore
from chunkcache.core.store.codec import EntryKey, namespace_of
from chunkcache.core.store.disk import LAYOUT

TESTS = Path(__file__).parent

WORKER = """
import sys
sys.path.insert(0, {tests!r})
from test_store_support import FP, make_variant
from chunkcache.core.store import DiskTier, TieredKVStore
from chunkcache.core.store.codec import namespace_of

root, prefix, count, tokens, capacity = sys.argv[1:6]
store = TieredKVStore([DiskTier(root, int(capacity))])
print("ready", flush=True)
for i in range(int(count)):
    store.put(FP, make_variant(f"{{prefix}}{{i}}", num_tokens=int(tokens), seed=i))
print("done", flush=True)
"""


def worker(
    root: Path, prefix: str, count: int, tokens: int, capacity: int
) -> subprocess.Popen[str]:
    code = WORKER.format(tests=str(TESTS))
    args = [sys.executable, "-c", code, str(root), prefix, str(count), str(tokens), str(capacity)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def disk_store(root: Path, capacity: int = 10_000_000) -> TieredKVStore:
    return TieredKVStore([DiskTier(root, capacity)])


def stored_files(root: Path, suffix: str) -> list[Path]:
    return sorted(p for p in root.rglob(f"*{suffix}") if not p.name.startswith("."))


def test_entries_survive_a_restart_with_metadata(tmp_path: Path) -> None:
    meta = CraftMeta(0.7, (0.1, 0.2, 0.3), ("sys", "c1"), (0.25, 0.5), (9, 17))
    k = torch.randn(2, 1, 3, 4, dtype=torch.bfloat16)
    rich = KVVariant("chunk", "ctx", 26, False, k, k * 2, meta, ReuseCount(3, 12.5))
    plain = make_variant("plain")
    store = disk_store(tmp_path)
    store.put(FP, rich)
    store.put(FP, plain)
    reopened = disk_store(tmp_path)
    assert len(reopened.tiers[0]) == 2
    assert reopened.tiers[0].num_bytes == store.tiers[0].num_bytes > 0
    (got,) = reopened.variants(FP, "chunk")
    assert (got.start, got.exact, got.meta, got.k.dtype) == (26, False, meta, torch.bfloat16)
    assert (got.reuse.num_reuses, got.reuse.frequency_reuse) == (3, 12.5)
    assert same_kv(got, rich) and same_kv(reopened.exact(FP, "plain", "root"), plain)
    names = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert not any("chunk" in n or "plain" in n or "ctx" in n for n in names)  # hashes only


@pytest.mark.parametrize("part", ["data", "header", "truncated", "data deleted"])
def test_a_damaged_entry_is_dropped_counted_and_missed(tmp_path: Path, part: str) -> None:
    store = disk_store(tmp_path)
    a = make_variant("a", num_tokens=8)
    store.put(FP, a)
    (data,) = stored_files(tmp_path, ".safetensors")
    (header,) = stored_files(tmp_path, ".json")
    if part == "data deleted":  # while a process has the tier open: it finds out on read
        data.unlink()
        assert a_key(store) not in store.tiers[0]
        assert store.exact(FP, "a", "root") is None
        assert store.metrics()["corrupt_dropped"] == 1 and not header.exists()
        store.put(FP, a)
        assert same_kv(disk_store(tmp_path).exact(FP, "a", "root"), a)
        return
    if part == "data":
        raw = bytearray(data.read_bytes())
        raw[-5] ^= 0x01  # one bit of one tensor element
        data.write_bytes(bytes(raw))
    elif part == "header":
        fields = json.loads(header.read_text())
        fields["start"] = 1  # valid JSON, wrong position
        header.write_text(json.dumps(fields))
    else:
        data.write_bytes(data.read_bytes()[:100])
    reopened = disk_store(tmp_path)
    assert reopened.exact(FP, "a", "root") is None
    assert reopened.metrics()["corrupt_dropped"] == 1
    assert not data.exists() and not header.exists()
    reopened.put(FP, a)  # recomputed and stored again
    assert same_kv(disk_store(tmp_path).exact(FP, "a", "root"), a)


def a_key(store: TieredKVStore) -> EntryKey:
    tier = store.tiers[0]
    assert isinstance(tier, DiskTier)
    (key,) = tier.entry_keys()
    return key


def test_damaged_bookkeeping_files_are_repaired_on_open(tmp_path: Path) -> None:
    """A header whose data was deleted, a temp file of no writer, a garbled ``.epoch``."""
    store = disk_store(tmp_path)
    store.put(FP, make_variant("a"))
    (data,) = stored_files(tmp_path, ".safetensors")
    data.unlink()
    stray = data.with_name(".tmp.partial")
    stray.write_bytes(b"x")
    (tmp_path / ".epoch").write_bytes(b"\xff\xfe garbage")
    reopened = disk_store(tmp_path)
    assert [p for p in (tmp_path / LAYOUT).rglob("*") if p.is_file()] == []
    assert len(reopened.tiers[0]) == 0 and reopened.tiers[0].num_bytes == 0
    b = make_variant("b")
    reopened.put(FP, b)
    assert same_kv(disk_store(tmp_path).exact(FP, "b", "root"), b)


def test_a_write_that_fails_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk: the temp files written so far are removed, nothing is committed."""
    store = disk_store(tmp_path)
    fsync = os.fsync
    calls = iter(range(2))

    def full_on_second_file(fd: int) -> None:
        if next(calls, 1) == 1:
            raise OSError(28, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", full_on_second_file)
    store.put(FP, make_variant("a"))  # the data temp is written, the header's fails
    monkeypatch.undo()
    assert [p for p in tmp_path.rglob("*") if p.is_file() and p.parent != tmp_path] == []
    assert store.metrics()["tiers"]["disk"]["errors"] == 1
    assert len(disk_store(tmp_path).tiers[0]) == 0


def test_one_fingerprint_never_reads_another(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    a = make_variant("a")
    store.put("model-A", a)
    assert store.exact("model-B", "a", "root") is None
    assert store.variants("model-B", "a") == []
    # files copied into B's namespace by hand are still refused: the header names model-A
    disk_store(tmp_path).put("model-B", make_variant("other"))
    a_ns, b_ns = (tmp_path / LAYOUT / namespace_of(fp) for fp in ("model-A", "model-B"))
    for path in sorted(a_ns.rglob("*")):
        target = b_ns / path.relative_to(a_ns)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.write_bytes(path.read_bytes())
    fresh = disk_store(tmp_path)
    assert fresh.exact("model-B", "a", "root") is None
    assert fresh.metrics()["corrupt_dropped"] == 1
    assert same_kv(fresh.exact("model-A", "a", "root"), a)


@pytest.mark.slow  # starts Python subprocesses that import torch
def test_sigkill_during_writes_leaves_no_corrupt_entry(tmp_path: Path) -> None:
    rng = random.Random(3)
    tokens = 1500  # ~96 kB an entry: kills land inside writes
    for _ in range(4):
        proc = worker(tmp_path, "s", 400, tokens, 10**9)
        time.sleep(rng.uniform(0.05, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    store = disk_store(tmp_path, 10**9)
    headers = stored_files(tmp_path, ".json")
    assert headers, "the worker never committed an entry"
    for header in headers:
        name = json.loads(header.read_text())["segment_id"]
        expected = make_variant(name, num_tokens=tokens, seed=int(name[1:]))
        assert same_kv(store.exact(FP, name, "root"), expected)
    assert store.metrics()["corrupt_dropped"] == 0
    leftovers = [p for p in tmp_path.rglob("*") if p.name.startswith(".tmp.")]
    assert leftovers == []
    assert len(stored_files(tmp_path, ".safetensors")) == len(headers)  # orphans swept


@pytest.mark.slow  # starts Python subprocesses that import torch
def test_two_processes_writing_one_directory_lose_nothing(tmp_path: Path) -> None:
    procs = [worker(tmp_path, prefix, 40, 16, 10**9) for prefix in ("p", "q")]
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.strip() == "done"
    store = disk_store(tmp_path, 10**9)
    for prefix in ("p", "q"):
        for i in range(40):
            expected = make_variant(f"{prefix}{i}", num_tokens=16, seed=i)
            assert same_kv(store.exact(FP, f"{prefix}{i}", "root"), expected)
    assert store.metrics()["corrupt_dropped"] == 0


@pytest.mark.slow  # starts Python subprocesses that import torch
def test_two_processes_share_one_capacity(tmp_path: Path) -> None:
    capacity = 20_000  # room for about 10 of the ~2 kB entries
    procs = [worker(tmp_path, prefix, 40, 16, capacity) for prefix in ("p", "q")]
    for proc in procs:
        proc.communicate(timeout=120)
        assert proc.returncode == 0
    assert 0 < tree_bytes(tmp_path) <= capacity
    store = disk_store(tmp_path, capacity)
    assert store.tiers[0].num_bytes == tree_bytes(tmp_path)


def test_orphans_of_a_dead_writer_are_swept(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    store.put(FP, make_variant("a"))
    (data,) = stored_files(tmp_path, ".safetensors")
    orphan = data.with_name("0" * 32 + ".safetensors")
    orphan.write_bytes(data.read_bytes())
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    temp = data.with_name(f".tmp.{int(dead.stdout)}.1.x.json")
    temp.write_text("{")
    mine = data.with_name(f".tmp.{os.getpid()}.1.y.json")
    mine.write_text("{")
    disk_store(tmp_path)
    assert not orphan.exists() and not temp.exists()
    assert mine.exists()  # a live writer's temp file is left alone
    mine.unlink()


def test_a_failing_disk_degrades_to_misses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Disk errors (here: the layout directory replaced by a file) never fail a request."""
    import shutil

    from chunkcache.core.store import MemoryTier

    host = MemoryTier("host", make_variant("x").num_bytes)
    store = TieredKVStore([host, DiskTier(tmp_path, 10**6)], write_through=True)
    a, b = make_variant("a"), make_variant("b", seed=1)
    store.put(FP, a)
    store.flush()
    shutil.rmtree(tmp_path / LAYOUT)
    (tmp_path / LAYOUT).write_text("not a directory")
    store.put(FP, b)  # a is evicted from host; its disk copy is unreadable, b's write fails
    store.flush()
    assert store.exact(FP, "a", "root") is None
    assert same_kv(store.exact(FP, "b", "root"), b)
    errors = store.metrics()["tiers"]["disk"]["errors"]
    assert errors >= 2
    warnings = [r for r in caplog.records if "the disk tier failed" in r.getMessage()]
    assert len([r for r in warnings if r.levelname == "WARNING"]) == 1

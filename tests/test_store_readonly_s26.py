"""A disk tier on a directory the process cannot write: a pre-warmed cache shipped read-only
(a read-only volume, a cache baked into an image, chmod 0555, EROFS) is served, never written.
And a directory that turns read-only or full after start-up fails no request and loses
nothing already stored.

Tests may run as root, where chmod does not stop writes: :class:`ReadOnlyMount` makes a
directory behave as a read-only mount does (every write under it fails with EROFS) by
wrapping the ``os``/``io`` calls that write; the real-chmod test runs only as another user.
"""

from __future__ import annotations

import builtins
import errno
import io
import logging
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_store_support import FP, make_variant, same_kv, tree_bytes

from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore
from chunkcache.core.store.codec import entry_key

SIZE = make_variant("x").num_bytes
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class ReadOnlyMount:
    """While ``on``, every write under ``root`` fails with ``error`` (EROFS by default), as
    on a read-only mount; reads go through.  With ENOSPC, files that exist still open and
    delete, as on a full disk."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = str(root)
        self.on = False
        self.error = errno.EROFS
        self.refused = 0
        for name in ("unlink", "remove", "rmdir"):  # a full disk still deletes
            monkeypatch.setattr(os, name, self._guard(getattr(os, name), self._not_full))
        for name in ("replace", "rename"):
            monkeypatch.setattr(os, name, self._guard(getattr(os, name), lambda *a: True, 2))
        monkeypatch.setattr(os, "mkdir", self._guard(os.mkdir, _absent))
        monkeypatch.setattr(os, "open", self._guard(os.open, self._writes_flags))
        opener = self._guard(builtins.open, _writes_mode)
        monkeypatch.setattr(builtins, "open", opener)
        monkeypatch.setattr(io, "open", opener)

    def _guard(
        self, call: Callable[..., Any], writes: Callable[..., bool], paths: int = 1
    ) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            names = [a for a in args[:paths] if isinstance(a, (str, os.PathLike))]
            mine = kwargs.get("dir_fd") is None and any(self._under(n) for n in names)
            if self.on and mine and writes(*args, **kwargs):
                self.refused += 1
                raise OSError(self.error, os.strerror(self.error), os.fspath(names[0]))
            return call(*args, **kwargs)

        return guarded

    def _not_full(self, *_: Any, **__: Any) -> bool:
        return self.error != errno.ENOSPC

    def _writes_flags(self, path: Any, flags: int, *_: Any, **__: Any) -> bool:
        if self.error == errno.ENOSPC:  # a full disk still opens what exists
            return bool(flags & os.O_CREAT) and _absent(path)
        return bool(flags & _WRITE_FLAGS)

    def _under(self, name: str | os.PathLike[str]) -> bool:
        path = os.path.abspath(os.fspath(name))
        return path == self.root or path.startswith(self.root + os.sep)


def _absent(path: Any, *_: Any, **__: Any) -> bool:
    return not os.path.lexists(path)  # mkdir of what exists says EEXIST first, as Linux does


def _writes_mode(_: Any, mode: str = "r", *__: Any, **___: Any) -> bool:
    return any(c in mode for c in "wax+")


@pytest.fixture
def mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ReadOnlyMount]:
    yield ReadOnlyMount(tmp_path / "kv", monkeypatch)


def warm(root: Path, *segments: str) -> None:
    """A disk cache holding ``segments`` (seed = position), written by an earlier process."""
    store = TieredKVStore([DiskTier(root, 10**6)])
    for seed, segment in enumerate(segments):
        store.put(FP, make_variant(segment, seed=seed))
    store.close()


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def read_only_store(root: Path, host_entries: int = 1) -> TieredKVStore:
    host = MemoryTier("host", host_entries * SIZE)
    return TieredKVStore([host, DiskTier(root, 10**6)], write_through=True)


# -- read-only from the start ---------------------------------------------------------------


def test_a_read_only_directory_opens_with_one_warning_and_serves_its_entries(
    tmp_path: Path, mount: ReadOnlyMount, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "kv"
    warm(root, "a", "b", "c")
    before = files_of(root)
    mount.on = True
    with caplog.at_level(logging.WARNING):
        store = read_only_store(root)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "read-only" in warnings[0] and str(root) in warnings[0]
    assert "Read-only file system" in warnings[0]  # why
    assert store.tiers[1].read_only  # type: ignore[attr-defined]
    assert same_kv(store.exact(FP, "a", "root"), make_variant("a", seed=0))
    (lazy,) = store.variants(FP, "b")
    assert same_kv(lazy, make_variant("b", seed=1))
    assert store.prefetch(FP, ["c"]).result() == 1
    assert entry_key(FP, "c", "root") in store.tiers[0]
    assert store.metrics()["tiers"]["disk"]["entries"] == 3
    assert files_of(root) == before


def test_puts_on_a_read_only_directory_are_skipped_not_failed(
    tmp_path: Path, mount: ReadOnlyMount, caplog: pytest.LogCaptureFixture
) -> None:
    """Write-through and demotion skip the disk: no error, no exception, nothing written;
    an entry promoted from the disk is just freed from the host (the disk copy stays)."""
    root = tmp_path / "kv"
    warm(root, "a")
    before = files_of(root)
    mount.on = True
    store = read_only_store(root, host_entries=1)
    caplog.clear()
    mount.refused = 0  # the open's own probe
    for i in range(4):  # each put evicts the last one from the one-entry host
        store.put(FP, make_variant(f"new{i}", seed=10 + i))
    store.flush()
    assert same_kv(store.exact(FP, "a", "root"), make_variant("a", seed=0))  # promoted
    store.put(FP, make_variant("new4", seed=14))  # evicts the promoted a: the disk has it
    store.flush()
    assert same_kv(store.exact(FP, "a", "root"), make_variant("a", seed=0))
    assert store.exact(FP, "new0", "root") is None  # dropped: the disk did not take it
    counts = store.metrics()["tiers"]["disk"]
    assert counts["errors"] == 0 and counts["entries"] == 1
    assert mount.refused == 0  # nothing even tried to write
    assert files_of(root) == before
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_corrupt_entry_on_a_read_only_directory_is_missed_once(
    tmp_path: Path, mount: ReadOnlyMount
) -> None:
    """It cannot be deleted, so the tier forgets it: counted once, then absent."""
    root = tmp_path / "kv"
    warm(root, "a")
    (data,) = root.rglob("*.safetensors")
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    mount.on = True
    store = read_only_store(root)
    assert store.exact(FP, "a", "root") is None
    assert store.variants(FP, "a") == [] and not store.contains_segment(FP, "a")
    counts = store.metrics()["tiers"]["disk"]
    assert counts["corrupt_dropped"] == 1 and counts["errors"] == 0 and counts["entries"] == 0
    assert data.exists()


def test_a_read_only_directory_without_the_layout_is_an_empty_tier(
    tmp_path: Path, mount: ReadOnlyMount
) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    mount.on = True
    store = read_only_store(root)
    store.put(FP, make_variant("a"))
    store.flush()
    assert store.metrics()["tiers"]["disk"]["entries"] == 0
    assert list(root.iterdir()) == []


def test_a_directory_that_cannot_be_created_fails_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ReadOnlyMount(tmp_path, monkeypatch).on = True
    missing = tmp_path / "absent" / "kv"
    with pytest.raises(OSError, match="cannot create the disk tier's directory") as raised:
        TieredKVStore.from_settings(disk_dir=missing, host_bytes=SIZE, disk_bytes=10**6)
    assert raised.value.filename == str(missing)
    assert raised.value.errno == errno.EROFS


def test_a_leftover_the_process_cannot_delete_does_not_stop_the_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The open sweeps a dead writer's temp file; one in a read-only subdirectory stays, and
    the tier opens writable."""
    root = tmp_path / "kv"
    warm(root, "a")
    (header,) = root.rglob("*.json")
    leftover = header.with_name(".tmp.999999999.1.x.json")  # no such process
    leftover.write_text("{")
    ReadOnlyMount(header.parent, monkeypatch).on = True
    store = read_only_store(root)
    assert not store.tiers[1].read_only  # type: ignore[attr-defined]
    assert same_kv(store.exact(FP, "a", "root"), make_variant("a", seed=0))
    assert leftover.exists()


def chmod_stops_writes(folder: Path) -> bool:
    """False for root (CAP_DAC_OVERRIDE writes through any mode)."""
    folder.mkdir()
    folder.chmod(0o555)
    try:
        (folder / "probe").touch()
    except PermissionError:
        return True
    finally:
        folder.chmod(0o755)
    return False


def test_a_chmod_read_only_directory_is_served(tmp_path: Path) -> None:
    if not chmod_stops_writes(tmp_path / "probe"):
        pytest.skip("this user writes through chmod 0555 (root): ReadOnlyMount tests cover it")
    root = tmp_path / "kv"
    warm(root, "a")
    paths = sorted(root.rglob("*"), key=lambda p: -len(p.parts))  # files before their folder
    for path in [*paths, root]:
        path.chmod(0o444 if path.is_file() else 0o555)
    try:
        store = read_only_store(root)
        assert store.tiers[1].read_only  # type: ignore[attr-defined]
        assert same_kv(store.exact(FP, "a", "root"), make_variant("a", seed=0))
        store.put(FP, make_variant("b"))
        store.flush()
        assert store.metrics()["tiers"]["disk"]["errors"] == 0
    finally:
        for path in [root, *paths]:
            path.chmod(0o644 if path.is_file() else 0o755)


# -- read-only or full after start-up -------------------------------------------------------


@pytest.mark.parametrize("failure", [errno.EROFS, errno.ENOSPC])
def test_a_directory_failing_writes_after_start_up_fails_no_request_and_loses_nothing(
    tmp_path: Path, mount: ReadOnlyMount, failure: int
) -> None:
    root = tmp_path / "kv"
    warm(root, "a", "b")
    store = read_only_store(root, host_entries=1)
    assert not store.tiers[1].read_only  # type: ignore[attr-defined]
    mount.error, mount.on = failure, True
    for i in range(4):  # write-through and demotion both fail
        store.put(FP, make_variant(f"new{i}", seed=10 + i))
    store.flush()
    assert same_kv(store.exact(FP, "a", "root"), make_variant("a", seed=0))
    assert same_kv(store.variants(FP, "b")[0], make_variant("b", seed=1))
    assert store.prefetch(FP, ["a", "b"]).result() >= 0
    assert mount.refused > 0 and store.metrics()["tiers"]["disk"]["errors"] > 0
    mount.on = False
    reopened = TieredKVStore([DiskTier(root, 10**6)])
    assert same_kv(reopened.exact(FP, "a", "root"), make_variant("a", seed=0))
    assert same_kv(reopened.exact(FP, "b", "root"), make_variant("b", seed=1))
    assert store.metrics()["tiers"]["disk"]["bytes"] == tree_bytes(root)


def test_a_full_disk_at_start_up_opens_writable_and_serves_its_entries(
    tmp_path: Path, mount: ReadOnlyMount
) -> None:
    """Full is not read-only: the writes fail (counted) until there is room again."""
    root = tmp_path / "kv"
    warm(root, "a")
    mount.error, mount.on = errno.ENOSPC, True
    store = read_only_store(root)
    assert not store.tiers[1].read_only  # type: ignore[attr-defined]
    assert same_kv(store.exact(FP, "a", "root"), make_variant("a", seed=0))
    store.put(FP, make_variant("b", seed=1))
    store.flush()
    assert store.metrics()["tiers"]["disk"]["errors"] > 0
    mount.on = False
    store.put(FP, make_variant("c", seed=2))
    store.flush()
    assert same_kv(
        TieredKVStore([DiskTier(root, 10**6)]).exact(FP, "c", "root"), make_variant("c", seed=2)
    )


def test_a_commit_whose_epoch_bump_fails_is_still_a_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry is in place once its header is renamed; a disk filling up just then (the
    ``.epoch`` write) must not report the put failed, nor leave it out of the byte index."""
    root = tmp_path / "kv"
    store = read_only_store(root, host_entries=1)
    write_text = Path.write_text

    def full(path: Path, *args: Any, **kwargs: Any) -> int:
        if path.name == ".epoch":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    store.put(FP, make_variant("a"))
    store.flush()
    monkeypatch.undo()
    counts = store.metrics()["tiers"]["disk"]
    assert counts["errors"] == 0 and counts["entries"] == 1
    assert counts["bytes"] == tree_bytes(root)


def test_a_commit_whose_directory_fsync_fails_is_in_the_byte_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header rename commits the entry; the directory's fsync failing after it is an
    error counted, but the index must still hold the entry's bytes."""
    root = tmp_path / "kv"
    store = read_only_store(root, host_entries=1)
    fsync = os.fsync

    def failing_on_folders(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_on_folders)
    store.put(FP, make_variant("a"))
    store.flush()
    monkeypatch.undo()
    assert store.metrics()["tiers"]["disk"]["bytes"] == tree_bytes(root) > 0

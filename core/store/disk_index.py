"""The disk tier's directory: where entries live, which exist, and who may change them.

One :class:`DiskIndex` per :class:`~chunkcache.core.store.disk.DiskTier`.  It knows each
entry's two paths, keeps the byte index (rebuilt from the directory on open, and again
whenever another process changed it: ``.epoch``), holds the thread lock and the file lock
for changes (:meth:`DiskIndex.locked`), and sweeps what killed writers and older formats
left behind.  Entry IO (encode, decode, lazy opens) is the tier's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock

from chunkcache.core.store import codec
from chunkcache.core.store.codec import EntryKey

LAYOUT = f"v{codec.FORMAT_VERSION}"


class DiskIndex:
    """The entries under ``root / LAYOUT`` and their sizes (bytes of header and data)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data_root = root / LAYOUT
        self.data_root.mkdir(parents=True, exist_ok=True)
        self._flock = FileLock(str(root / ".lock"))
        self._lock = threading.RLock()
        self._sizes: dict[EntryKey, int] = {}
        self._bytes = 0
        self._epoch = ""
        with self.locked():
            self._sweep()
            self._rescan()

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[EntryKey]:
        with self._lock:
            return list(self._sizes)

    def paths(self, key: EntryKey) -> tuple[Path, Path]:
        """The entry's data and header files."""
        folder = self.data_root / key.namespace / key.segment[:2] / key.segment
        return folder / f"{key.context}.safetensors", folder / f"{key.context}.json"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """This thread and process alone in the directory, with an index that is current."""
        with self._lock, self._flock:
            if _read_epoch(self.root) != self._epoch:
                self._rescan()
            yield
            self._epoch = _bump_epoch(self.root)

    def added(self, key: EntryKey, size: int) -> None:
        """``key`` was committed with ``size`` bytes (under :meth:`locked`)."""
        self._sizes[key] = size
        self._bytes += size

    def remove_files(self, key: EntryKey) -> None:
        """Uncommit and delete ``key`` (under :meth:`locked`)."""
        data_path, header_path = self.paths(key)
        for path in (header_path, data_path):  # uncommit first
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._bytes -= self._sizes.pop(key, 0)

    def _rescan(self) -> None:
        sizes: dict[EntryKey, int] = {}
        for header_path in self.data_root.glob("*/*/*/*.json"):
            if header_path.name.startswith(".tmp."):
                continue
            ns, _, seg = header_path.parts[-4:-1]
            data_path = header_path.with_suffix(".safetensors")
            try:
                sizes[EntryKey(ns, seg, header_path.stem)] = (
                    header_path.stat().st_size + data_path.stat().st_size
                )
            except FileNotFoundError:
                continue  # removed meanwhile, or a header without data: corrupt when read
        self._sizes = sizes
        self._bytes = sum(sizes.values())
        self._epoch = _read_epoch(self.root)

    def _sweep(self) -> None:
        """Remove what a killed writer left (data without a header, dead writers' temp
        files), headers whose data was deleted, and the directories of older formats."""
        for old in self.root.glob("v*"):
            version = old.name[1:]
            if old.is_dir() and version.isdigit() and int(version) < codec.FORMAT_VERSION:
                shutil.rmtree(old, ignore_errors=True)
        for path in self.data_root.glob("*/*/*/*"):
            if path.name.startswith(".tmp."):
                if not _writer_alive(path.name):
                    path.unlink(missing_ok=True)
            elif path.suffix in (".safetensors", ".json") and not _pair(path).exists():
                path.unlink(missing_ok=True)


def _pair(path: Path) -> Path:
    """An entry's other file: the header of a data file, the data of a header."""
    return path.with_suffix(".json" if path.suffix == ".safetensors" else ".safetensors")


def _writer_alive(temp_name: str) -> bool:
    """Whether the process that names a ``.tmp.<pid>.<thread>.<name>`` file still runs."""
    pid = temp_name.split(".")[2]
    return pid.isdigit() and _alive(int(pid))


def _read_epoch(root: Path) -> str:
    """The directory's change counter; damaged bytes read as some value, which only means
    a rescan (the next change writes a fresh one)."""
    try:
        return (root / ".epoch").read_bytes().decode("utf-8", "replace")
    except FileNotFoundError:
        return "0"


def _bump_epoch(root: Path) -> str:
    """Another value than any process saw, so every other process rescans."""
    value = f"{os.getpid()}-{os.urandom(6).hex()}"
    (root / ".epoch").write_text(value)
    return value


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

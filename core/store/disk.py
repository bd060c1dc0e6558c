"""The disk tier: one directory, shared safely by several processes (RAG-DCache §III).

Layout (every name a hash, :mod:`chunkcache.core.store.codec`)::

    root/.lock                     filelock held while committing or evicting
    root/.epoch                    bumped on every change; another number means rescan
    root/v2/<ns>/<seg[:2]>/<seg>/<ctx>.safetensors   k, v: [L, H_kv, n, D] each
    root/v2/<ns>/<seg[:2]>/<seg>/<ctx>.json          header; its presence commits the entry

The ``v2`` directory is the codec's format version (format 2: a checksum per layer in the
header).  Directories of older formats are removed when a tier opens: their entries are
misses, never read.

A write goes to temp files first (fsync), then, under the lock, the old header is removed,
the data renamed into place, then the header (the commit), then the directory fsynced.  A
process killed at any point leaves either the old entry, no entry, or the new entry, plus at
worst a data file without a header or a temp file, both swept on the next open.  Reads take
no lock.  :meth:`DiskTier.get` reads a whole entry and verifies its header and every layer
(codec.decode).  :meth:`DiskTier.open_lazy` reads and verifies only the header and opens the
data file; its layers are then read one at a time, each verified against its checksum as it
is read (:class:`~chunkcache.core.store.layer_file.LayerFile`), so a disk hit's read hides
behind compute (:mod:`chunkcache.core.store.lazy`).  The byte index is rebuilt from the
directory on open, and again whenever another process changed the directory (``.epoch``),
so capacity holds across processes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock

from chunkcache.core.kv_store import KVVariant, ReuseCount
from chunkcache.core.store import codec
from chunkcache.core.store.codec import CorruptEntryError, EntryKey
from chunkcache.core.store.layer_file import LayerFile
from chunkcache.core.store.tier import Evicted, Victim

LAYOUT = f"v{codec.FORMAT_VERSION}"
T = TypeVar("T")


@dataclass(frozen=True)
class PreparedWrite:
    """An entry written to temp files, waiting for :meth:`DiskTier.commit`."""

    key: EntryKey
    size: int
    temps: tuple[Path, Path]  # data, header


class DiskTier:
    """Entries as safetensors + JSON files under ``root``, at most ``capacity_bytes``."""

    def __init__(self, root: str | Path, capacity_bytes: int, name: str = "disk") -> None:
        if capacity_bytes < 1:
            raise ValueError(f"{name}: capacity_bytes must be positive")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.root = Path(root)
        self.data_root = self.root / LAYOUT
        self.data_root.mkdir(parents=True, exist_ok=True)
        self._flock = FileLock(str(self.root / ".lock"))
        self._lock = threading.RLock()
        self._sizes: dict[EntryKey, int] = {}
        self._bytes = 0
        self._epoch = ""
        with self._locked():
            self._sweep()
            self._rescan()

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: EntryKey) -> bool:
        return self._paths(key)[1].exists()

    def entry_keys(self) -> list[EntryKey]:
        with self._lock:
            return list(self._sizes)

    def segment_keys(self, namespace: str, segment: str) -> list[EntryKey]:
        folder = self.data_root / namespace / segment[:2] / segment
        try:
            names = os.listdir(folder)
        except OSError:  # absent, or the disk fails: get/put count the failure
            return []
        return [
            EntryKey(namespace, segment, n[:-5])
            for n in names
            if n.endswith(".json") and not n.startswith(".")  # not a writer's temp file
        ]

    def reuse_of(self, key: EntryKey) -> ReuseCount | None:
        """The reuse counters saved in an entry's header (for a policy that needs them)."""
        try:
            header = codec.parse_header(self._paths(key)[1].read_bytes())
            return ReuseCount(int(header["num_reuses"]), float(header["frequency_reuse"]))
        except (OSError, CorruptEntryError, KeyError, TypeError, ValueError):
            return None

    def get(self, key: EntryKey, fingerprint: str) -> KVVariant | None:
        return self._retrying(key, lambda: self._read(key, fingerprint))

    def open_lazy(self, key: EntryKey, fingerprint: str) -> tuple[dict[str, Any], LayerFile] | None:
        """An entry's verified header and its data file opened for per-layer reads (no
        tensor bytes read yet); None if absent.  Raises ``CorruptEntryError`` (the entry
        removed) if the header or the data file's tensor table fails its checks."""
        return self._retrying(key, lambda: self._open(key, fingerprint))

    def put(
        self, key: EntryKey, fingerprint: str, variant: KVVariant, victim: Victim, evicted: Evicted
    ) -> bool:
        prepared = self.prepare(key, fingerprint, variant)
        return prepared is not None and self.commit(prepared, victim, evicted)

    def prepare(self, key: EntryKey, fingerprint: str, variant: KVVariant) -> PreparedWrite | None:
        """The slow part of :meth:`put`, no lock held: encode and write the temp files
        (fsynced).  None if the entry can never fit."""
        data, header = codec.encode(fingerprint, variant)
        raw = codec.header_bytes(header)
        if len(data) + len(raw) > self.capacity_bytes:
            return None
        data_path, header_path = self._paths(key)
        data_path.parent.mkdir(parents=True, exist_ok=True)
        temps = (_write_temp(data_path, data), _write_temp(header_path, raw))
        return PreparedWrite(key, len(data) + len(raw), temps)

    def commit(self, prepared: PreparedWrite, victim: Victim, evicted: Evicted) -> bool:
        """The quick part of :meth:`put`, under the lock: make room, rename into place."""
        key, size = prepared.key, prepared.size
        data_path, header_path = self._paths(key)
        tmp_data, tmp_header = prepared.temps
        try:
            with self._locked():
                self._remove_files(key)
                while self._sizes and self.num_bytes + size > self.capacity_bytes:
                    out = victim(list(self._sizes))
                    evicted(out, functools.partial(self._load_quietly, out))
                    self._remove_files(out)
                os.replace(tmp_data, data_path)
                os.replace(tmp_header, header_path)  # the commit
                _fsync_dir(data_path.parent)
                self._sizes[key] = size
                self._bytes += size
        finally:
            for tmp in (tmp_data, tmp_header):
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
        return True

    def remove(self, key: EntryKey) -> None:
        with self._locked():
            self._remove_files(key)

    # -- internals -------------------------------------------------------------------------

    def _paths(self, key: EntryKey) -> tuple[Path, Path]:
        folder = self.data_root / key.namespace / key.segment[:2] / key.segment
        return folder / f"{key.context}.safetensors", folder / f"{key.context}.json"

    def _read(self, key: EntryKey, fingerprint: str) -> KVVariant:
        data_path, header_path = self._paths(key)
        header = codec.parse_header(header_path.read_bytes())
        return codec.decode(data_path.read_bytes(), header, fingerprint, key)

    def _open(self, key: EntryKey, fingerprint: str) -> tuple[dict[str, Any], LayerFile]:
        data_path, header_path = self._paths(key)
        raw = header_path.read_bytes()
        header = codec.parse_header(raw)
        codec.verify_header(header, fingerprint, key)
        layers = LayerFile(data_path, header)
        if header_path.read_bytes() != raw:  # replaced meanwhile: the data may be the new one
            layers.close()
            raise CorruptEntryError("entry replaced while it was opened")
        return header, layers

    def _retrying(self, key: EntryKey, read: Callable[[], T]) -> T | None:
        """``read()``; None if the entry is gone.  A corrupt verdict is checked once more
        under the lock (a writer may have been replacing the entry), then the entry removed."""
        try:
            return read()
        except FileNotFoundError:
            return None  # evicted by another process between lookup and read
        except CorruptEntryError:
            with self._locked():
                try:
                    return read()
                except FileNotFoundError:
                    return None
                except CorruptEntryError:
                    self._remove_files(key)
                    raise

    def _load_quietly(self, key: EntryKey) -> tuple[str, KVVariant] | None:
        """An entry with the fingerprint its header names (the key's namespace binds the two)."""
        data_path, header_path = self._paths(key)
        try:
            header = codec.parse_header(header_path.read_bytes())
            fingerprint = str(header.get("fingerprint"))
            return fingerprint, codec.decode(data_path.read_bytes(), header, fingerprint, key)
        except (OSError, CorruptEntryError):
            return None  # damaged or gone: nothing to demote

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """This thread and process alone in the directory, with an index that is current."""
        with self._lock, self._flock:
            if _read_epoch(self.root) != self._epoch:
                self._rescan()
            yield
            self._epoch = _bump_epoch(self.root, self._epoch)

    def _remove_files(self, key: EntryKey) -> None:
        data_path, header_path = self._paths(key)
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
                continue  # removed meanwhile, or a header without data: a miss when read
        self._sizes = sizes
        self._bytes = sum(sizes.values())
        self._epoch = _read_epoch(self.root)

    def _sweep(self) -> None:
        """Remove what a killed writer left (data without a header, dead writers' temp files)
        and the directories of older formats."""
        for old in self.root.glob("v*"):
            version = old.name[1:]
            if old.is_dir() and version.isdigit() and int(version) < codec.FORMAT_VERSION:
                shutil.rmtree(old, ignore_errors=True)
        for path in self.data_root.glob("*/*/*/*"):
            if path.name.startswith(".tmp."):
                if not _alive(int(path.name.split(".")[2])):
                    path.unlink(missing_ok=True)
            elif path.suffix == ".safetensors" and not path.with_suffix(".json").exists():
                path.unlink(missing_ok=True)


def _write_temp(final: Path, payload: bytes) -> Path:
    tmp = final.with_name(f".tmp.{os.getpid()}.{threading.get_ident()}.{final.name}")
    with open(tmp, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    return tmp


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_epoch(root: Path) -> str:
    try:
        return (root / ".epoch").read_text()
    except FileNotFoundError:
        return "0"


def _bump_epoch(root: Path, seen: str) -> str:
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

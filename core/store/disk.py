"""The disk tier: one directory, shared safely by several processes (RAG-DCache §III).

Layout (every name a hash, :mod:`chunkcache.core.store.codec`)::

    root/.lock                     filelock held while committing or evicting
    root/.epoch                    bumped on every change; another number means rescan
    root/v3/<ns>/<seg[:2]>/<seg>/<ctx>.safetensors   k, v: [L, H_kv, n, D] each
    root/v3/<ns>/<seg[:2]>/<seg>/<ctx>.json          header; its presence commits the entry

The ``v3`` directory is the codec's format version (format 3: a segment id is a chunk key,
``<chunk id>#<hash of its tokens>``, and the header has a checksum per layer).
The entries of older formats are removed when a tier opens: they are misses, never read.
Only files of an entry's name are ever counted, swept or evicted, so the directory may hold
other files (even in folders named ``v1``, ``v2``), which stay.

A write goes to temp files first (fsync; removed if writing fails), then, under the lock,
room is made (an older entry under the same key counts as room and stays readable while
others are evicted: a commit interrupted there, or failing, keeps it), the old header is
removed, the data renamed into place, then the header (the commit), then the directory
fsynced.  A process killed at any point leaves either the old entry, no entry, or the new
entry, plus at worst a data file without a header or a temp file, both
swept on the next open (as is a header whose data someone deleted).  Removing an entry
removes its segment folder and the one above once empty (one per segment ever written would
pile up otherwise); a write whose new folder a removal took meanwhile makes it again.  Reads take
no lock.  :meth:`DiskTier.get` reads a whole entry and verifies its header and every layer
(codec.decode).  :meth:`DiskTier.open_lazy` reads and verifies only the header and opens the
data file; its layers are then read one at a time, each verified against its checksum as it
is read (:class:`~chunkcache.core.store.layer_file.LayerFile`), so a disk hit's read hides
behind compute (:mod:`chunkcache.core.store.lazy`).  The byte index is rebuilt from the
directory on open, and again whenever another process changed the directory (``.epoch``),
so capacity holds across processes (:class:`~chunkcache.core.store.disk_index.DiskIndex`:
paths, index, locks, sweep; this module: entry IO).

A directory this process cannot write (a pre-warmed cache on a read-only volume or baked
into an image) opens read-only, with one warning: its entries are read as ever, and a put
(write-through, demotion) is skipped as one that cannot fit, never an error.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from chunkcache.core.kv_store import KVVariant, ReuseCount
from chunkcache.core.store import codec
from chunkcache.core.store.codec import CorruptEntryError, EntryKey
from chunkcache.core.store.disk_index import LAYOUT, DiskIndex
from chunkcache.core.store.layer_file import LayerFile
from chunkcache.core.store.tier import Evicted, Victim

__all__ = ["LAYOUT", "DiskTier", "PreparedWrite"]
T = TypeVar("T")
log = logging.getLogger(__name__)


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
        self._index = DiskIndex(self.root)  # sweeps and scans the directory
        self.data_root = self._index.data_root
        if self._index.read_only_reason is not None:
            log.warning(
                "the %s tier's directory %s is read-only (%s): the %d entries there are "
                "served, nothing is written there",
                name,
                self.root,
                self._index.read_only_reason,
                len(self._index),
            )

    @property
    def read_only(self) -> bool:
        """Whether the directory cannot be written: entries are read, puts are skipped."""
        return self._index.read_only_reason is not None

    @property
    def num_bytes(self) -> int:
        return self._index.num_bytes

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: EntryKey) -> bool:
        if self._index.forgotten(key):
            return False
        try:
            return all(path.exists() for path in self._index.paths(key))
        except OSError:  # a failing disk (EIO, EACCES, NFS ESTALE): get/put count the failure
            return False

    def entry_keys(self) -> list[EntryKey]:
        return self._index.keys()

    def segment_keys(self, namespace: str, segment: str) -> list[EntryKey]:
        folder = self.data_root / namespace / segment[:2] / segment
        try:
            names = os.listdir(folder)
        except OSError:  # absent, or the disk fails: get/put count the failure
            return []
        keys = [
            EntryKey(namespace, segment, n[:-5])
            for n in names
            if n.endswith(".json") and not n.startswith(".")  # not a writer's temp file
        ]
        return [key for key in keys if not self._index.forgotten(key)]

    def reuse_of(self, key: EntryKey) -> ReuseCount | None:
        """The reuse counters saved in an entry's header (for a policy that needs them)."""
        try:
            header = codec.parse_header(self._index.paths(key)[1].read_bytes())
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
        (fsynced).  None if the entry can never fit, or the directory is read-only."""
        if self.read_only:
            return None
        data, header = codec.encode(fingerprint, variant)
        raw = codec.header_bytes(header)
        if len(data) + len(raw) > self.capacity_bytes:
            return None
        try:
            temps = self._write_temps(key, data, raw)
        except FileNotFoundError:  # a removal (unlocked from here) took the empty folder
            temps = self._write_temps(key, data, raw)
        return PreparedWrite(key, len(data) + len(raw), temps)

    def commit(self, prepared: PreparedWrite, victim: Victim, evicted: Evicted) -> bool:
        """The quick part of :meth:`put`, under the lock: make room, rename into place.
        An older entry under the key is replaced last, once room is made."""
        key, size = prepared.key, prepared.size
        data_path, header_path = self._index.paths(key)
        tmp_data, tmp_header = prepared.temps
        try:
            with self._index.locked():
                replaced = self._index.size_of(key)
                while self.num_bytes - replaced + size > self.capacity_bytes:
                    others = [k for k in self.entry_keys() if k != key]
                    if not others:
                        break
                    out = victim(others)
                    try:
                        evicted(out, functools.partial(self._load_quietly, out))
                    finally:  # even if interrupted: the store was told it is gone
                        self._index.remove_files(out)
                self._index.remove_files(key)
                os.replace(tmp_data, data_path)
                os.replace(tmp_header, header_path)  # the commit
                self._index.added(key, size)  # in place, even if the fsync below fails
                _fsync_dir(data_path.parent)
        finally:
            for tmp in (tmp_data, tmp_header):
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
        return True

    def remove(self, key: EntryKey) -> None:
        with self._index.locked():
            self._index.remove_files(key)

    # -- internals -------------------------------------------------------------------------

    def _write_temps(self, key: EntryKey, data: bytes, header: bytes) -> tuple[Path, Path]:
        """The entry's data and header in temp files in its (new or existing) folder."""
        data_path, header_path = self._index.paths(key)
        data_path.parent.mkdir(parents=True, exist_ok=True)
        tmp_data = _write_temp(data_path, data)
        try:
            tmp_header = _write_temp(header_path, header)
        except BaseException:
            tmp_data.unlink(missing_ok=True)
            raise
        return tmp_data, tmp_header

    def _read(self, key: EntryKey, fingerprint: str) -> KVVariant:
        data_path, header_path = self._index.paths(key)
        header = codec.parse_header(header_path.read_bytes())
        return codec.decode(data_path.read_bytes(), header, fingerprint, key)

    def _open(self, key: EntryKey, fingerprint: str) -> tuple[dict[str, Any], LayerFile]:
        data_path, header_path = self._index.paths(key)
        raw = header_path.read_bytes()
        header = codec.parse_header(raw)
        codec.verify_header(header, fingerprint, key)
        layers = LayerFile(data_path, header)
        if header_path.read_bytes() != raw:  # replaced meanwhile: the data may be the new one
            layers.close()
            raise CorruptEntryError("entry replaced while it was opened")
        return header, layers

    def _retrying(self, key: EntryKey, read: Callable[[], T]) -> T | None:
        """``read()``; None if the entry is gone.  A corrupt verdict, or a missing file, is
        checked once more under the lock (a writer may have been replacing the entry, or
        another process evicting it); a header still there without its data is corrupt.
        A corrupt entry is removed."""
        try:
            return read()
        except (FileNotFoundError, CorruptEntryError):
            pass
        with self._index.locked():
            try:
                return read()
            except FileNotFoundError as missing:
                if not self._index.paths(key)[1].exists():
                    return None  # evicted by another process between lookup and read
                self._index.remove_files(key)
                raise CorruptEntryError(f"header without its data: {missing}") from missing
            except CorruptEntryError:
                self._index.remove_files(key)
                raise

    def _load_quietly(self, key: EntryKey) -> tuple[str, KVVariant] | None:
        """An entry with the fingerprint its header names (the key's namespace binds the two)."""
        data_path, header_path = self._index.paths(key)
        try:
            header = codec.parse_header(header_path.read_bytes())
            fingerprint = str(header.get("fingerprint"))
            return fingerprint, codec.decode(data_path.read_bytes(), header, fingerprint, key)
        except (OSError, CorruptEntryError):
            return None  # damaged or gone: nothing to demote


def _write_temp(final: Path, payload: bytes) -> Path:
    """``payload`` in a fsynced temp file beside ``final``; nothing left if writing fails."""
    tmp = final.with_name(f".tmp.{os.getpid()}.{threading.get_ident()}.{final.name}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not keep the partial file's space
        raise
    return tmp


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""The disk tier's directory: where entries live, which exist, and who may change them.

One :class:`DiskIndex` per :class:`~chunkcache.core.store.disk.DiskTier`.  It knows each
entry's two paths, keeps the byte index (rebuilt from the directory on open, and again
whenever another process changed it: ``.epoch``), holds the thread lock and the file lock
for changes (:meth:`DiskIndex.locked`), and sweeps what killed writers and older formats
left behind.  Entry IO (encode, decode, lazy opens) is the tier's.

Only files of an entry's shape (:data:`_ENTRY_FILE`) are ever counted, swept or evicted: the
directory may be shared with files of someone else's, even in folders named like ours.
Removing an entry removes its segment folder and that folder's parent once they are empty
(only those: a folder still holding anything stays), as the sweep does for empty ones of an
entry's shape that older runs left.

A directory this process cannot write (a read-only mount, a cache baked into an image,
permissions) opens read-only (:attr:`DiskIndex.read_only_reason`): no file lock, no sweep,
no epoch, and an entry "removed" (corrupt, or replaced by a newer variant) is only forgotten
by this process, since its files cannot be deleted.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock

from chunkcache.core.store import codec
from chunkcache.core.store.codec import EntryKey

LAYOUT = f"v{codec.FORMAT_VERSION}"
# what a write meets in a directory this process may read but not write
_READ_ONLY_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
_HASH = "[0-9a-f]{32}"  # codec.digest
# A file of an entry below a layout folder (every format's shape so far):
# <ns>/<seg[:2]>/<seg>/<ctx>.json|.safetensors, or a writer's temp file beside them.
_ENTRY_FOLDER = rf"{_HASH}/([0-9a-f]{{2}})/\1[0-9a-f]{{30}}"
_ENTRY_FILE = re.compile(rf"{_ENTRY_FOLDER}/(\.tmp\..+|{_HASH}\.(json|safetensors))")


class DiskIndex:
    """The entries under ``root / LAYOUT`` and their sizes (bytes of header and data)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data_root = root / LAYOUT
        self._flock = FileLock(str(root / ".lock"))
        self._lock = threading.RLock()
        self._sizes: dict[EntryKey, int] = {}
        self._bytes = 0
        self._epoch = ""
        self._forgotten: set[EntryKey] = set()  # read-only: entries "removed" here
        # why the directory cannot be written (the first write refused), or None
        self.read_only_reason: str | None = None
        self._open()

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[EntryKey]:
        with self._lock:
            return list(self._sizes)

    def forgotten(self, key: EntryKey) -> bool:
        """Whether a read-only directory's entry was removed for this process."""
        return key in self._forgotten

    def paths(self, key: EntryKey) -> tuple[Path, Path]:
        """The entry's data and header files."""
        folder = self.data_root / key.namespace / key.segment[:2] / key.segment
        return folder / f"{key.context}.safetensors", folder / f"{key.context}.json"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """This thread and process alone in the directory, with an index that is current.
        The epoch is bumped even if the body failed midway: it may have changed files."""
        read_only = self.read_only_reason is not None
        with self._lock, contextlib.nullcontext() if read_only else self._flock:
            if _read_epoch(self.root) != self._epoch:
                self._rescan()
            try:
                yield
            finally:
                if not read_only:
                    self._epoch = _bump_epoch(self.root)

    def size_of(self, key: EntryKey) -> int:
        """Bytes of ``key``'s committed entry; 0 if there is none."""
        return self._sizes.get(key, 0)

    def added(self, key: EntryKey, size: int) -> None:
        """``key`` was committed with ``size`` bytes (under :meth:`locked`)."""
        self._sizes[key] = size
        self._bytes += size

    def remove_files(self, key: EntryKey) -> None:
        """Uncommit and delete ``key`` (under :meth:`locked`); only forget it if read-only."""
        if self.read_only_reason is not None:
            self._forgotten.add(key)
        else:
            data_path, header_path = self.paths(key)
            for path in (header_path, data_path):  # uncommit first
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            _remove_if_empty(data_path.parent)
        self._bytes -= self._sizes.pop(key, 0)

    def _open(self) -> None:
        """Create, sweep and scan the directory; read-only if this process may not write it.
        A directory that does not exist and cannot be created is an ``OSError`` naming it."""
        try:
            self.data_root.mkdir(parents=True, exist_ok=True)
            with self.locked():
                self._check_writable()
                self._sweep()
                self._rescan()
            return
        except OSError as error:
            if not self.root.is_dir():
                raise OSError(
                    error.errno,
                    f"cannot create the disk tier's directory ({error.strerror})",
                    str(self.root),
                ) from error
            if error.errno not in _READ_ONLY_ERRNOS:
                raise
            where = f": {error.filename}" if error.filename is not None else ""
            self.read_only_reason = f"{error.strerror}{where}"
        with self.locked():
            self._rescan()

    def _check_writable(self) -> None:
        """Raise what a write here meets when this process may not write (EROFS, EACCES):
        to the epoch file, and to a file of the layout (a writer's temp file name, so one
        a killed process left is swept)."""
        _open_to_write(self.root / ".epoch")
        probe = self.data_root / f".tmp.{os.getpid()}.{threading.get_ident()}.probe"
        _open_to_write(probe)
        _unlink_quietly(probe)

    def _rescan(self) -> None:
        sizes: dict[EntryKey, int] = {}
        for header_path in _entry_files(self.data_root, "*.json"):
            ns, _, seg = header_path.parts[-4:-1]
            key = EntryKey(ns, seg, header_path.stem)
            if header_path.name.startswith(".tmp.") or key in self._forgotten:
                continue
            data_path = header_path.with_suffix(".safetensors")
            try:
                sizes[key] = header_path.stat().st_size + data_path.stat().st_size
            except FileNotFoundError:
                continue  # removed meanwhile, or a header without data: corrupt when read
        self._sizes = sizes
        self._bytes = sum(sizes.values())
        self._epoch = _read_epoch(self.root)

    def _sweep(self) -> None:
        """Remove what a killed writer left (data without a header, dead writers' temp
        files), headers whose data was deleted, the entries of older formats, and the empty
        segment folders older runs left (only folders of an entry's shape)."""
        for old in self.root.glob("v*"):
            version = old.name[1:]
            if old.is_dir() and version.isdigit() and int(version) < codec.FORMAT_VERSION:
                _remove_entries(old)
        for path in _entry_files(self.data_root, "*"):
            if path.name.startswith(".tmp."):
                if not _writer_alive(path.name):
                    _unlink_quietly(path)
            elif path.suffix in (".safetensors", ".json") and not _pair(path).exists():
                _unlink_quietly(path)
        for folder in self.data_root.glob("*/*/*"):
            if re.fullmatch(_ENTRY_FOLDER, "/".join(folder.parts[-3:])):
                _remove_if_empty(folder)


def _entry_files(layout: Path, name: str) -> Iterator[Path]:
    """The files of entries (and temp files) below ``layout`` whose name matches ``name``."""
    for path in layout.glob(f"*/*/*/{name}"):
        if _ENTRY_FILE.fullmatch("/".join(path.parts[-4:])):
            yield path


def _remove_entries(layout: Path) -> None:
    """Delete the entry files below an older format's ``layout`` folder, then the folders
    they leave empty: anything else there is someone else's, and stays."""
    for path in list(_entry_files(layout, "*")):
        _unlink_quietly(path)
        for folder in (path.parent, path.parent.parent, path.parent.parent.parent, layout):
            with contextlib.suppress(OSError):  # not empty: it holds more
                folder.rmdir()


def _remove_if_empty(segment_folder: Path) -> None:
    """Remove an entry's segment folder and then its parent if they are empty: each would
    otherwise stay, an inode and a block, for every segment ever written, and every rescan
    would walk them.  One still holding files (another entry, a writer's temp file) stays."""
    for folder in (segment_folder, segment_folder.parent):
        try:
            folder.rmdir()
        except OSError:  # not empty, or gone
            return


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _open_to_write(path: Path) -> None:
    """Open ``path`` to write (created if absent), as a check: only a refusal to write is
    raised; a full or failing disk opens writable, and each write counts its failure."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o666))
    except OSError as error:
        if error.errno in _READ_ONLY_ERRNOS:
            raise


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
    """Another value than any process saw, so every other process rescans.  A disk that
    fails the write (full, turned read-only) fails no change made under the lock: "" then,
    so this process rescans unless the file was left empty, when every other one does."""
    value = f"{os.getpid()}-{os.urandom(6).hex()}"
    try:
        (root / ".epoch").write_text(value)
    except OSError:
        return ""
    return value


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

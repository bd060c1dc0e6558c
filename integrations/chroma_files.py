"""Checks and locks for the persistent Chroma directories of :mod:`.indexes`.

:func:`check_hnsw_files` reads Chroma's HNSW segment files (``header.bin``,
``data_level0.bin``, ``length.bin``, ``link_lists.bin``, the layout of Chroma's
hnswlib) and raises ``ValueError`` if they disagree with their header.  Chroma
itself loads them unchecked: a damaged ``link_lists.bin`` gives wrong results or
crashes the process (a segmentation fault, which no ``except`` catches), so the
check must run before Chroma opens the directory.  Nothing is unpickled
(``index_metadata.pickle`` is not read).

:func:`hold` takes a shared ``flock`` on ``<dir>.lock`` for as long as a process
builds or uses a Chroma directory; :func:`remove_unheld` deletes a directory only
if it can take that lock exclusively, so never one that another process is
building or reading.  A lock dies with its process, so a killed build leaves a directory
nobody holds.  Where ``fcntl`` is missing (Windows) nothing is locked and nothing
is removed.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
from pathlib import Path

import numpy as np

__all__ = ["check_hnsw_files", "hold", "lock_path", "remove_unheld"]

logger = logging.getLogger(__name__)

HNSW_FILES = ("header.bin", "data_level0.bin", "length.bin", "link_lists.bin")
# version; offsetLevel0, max_elements, cur_element_count, size_data_per_element,
# label_offset, offsetData; maxlevel, enterpoint_node; maxM, maxM0, M; mult; ef_construction
_HEADER = struct.Struct("<i6QiI3QdQ")
_PERSISTENCE_VERSION = 1
_LABEL_BYTES = 8  # labeltype: size_t
_ID = np.dtype("<u4")  # tableint and linklistsizeint (its low 16 bits: the list's count)


def check_hnsw_files(chroma_dir: Path, dim: int) -> None:
    """Raise ``ValueError`` unless every HNSW segment under ``chroma_dir`` is whole and
    consistent: sizes as the header says, every link list in range, the entry point on
    the top level, distinct labels.  A segment Chroma has not written yet is fine."""
    for segment in sorted(p for p in chroma_dir.iterdir() if p.is_dir()):
        present = [name for name in HNSW_FILES if (segment / name).is_file()]
        if not present:
            continue
        if len(present) < len(HNSW_FILES):
            missing = sorted(set(HNSW_FILES) - set(present))
            raise ValueError(f"HNSW segment {segment.name} lacks {', '.join(missing)}")
        try:
            _check_segment(segment, dim)
        except ValueError as error:
            raise ValueError(f"HNSW segment {segment.name}: {error}") from None


def _check_segment(segment: Path, dim: int) -> None:
    header = (segment / "header.bin").read_bytes()
    if len(header) != _HEADER.size:
        raise ValueError(f"header.bin has {len(header)} bytes, not {_HEADER.size}")
    (version, offset_level0, max_elements, count, per_element, label_offset, data_offset,
     max_level, entry, max_m, max_m0, _, _, _) = _HEADER.unpack(header)  # fmt: skip
    links0 = (max_m0 + 1) * _ID.itemsize
    if (version, offset_level0, data_offset) != (_PERSISTENCE_VERSION, 0, links0) or not (
        label_offset == data_offset + dim * 4 == per_element - _LABEL_BYTES
        and count <= max_elements
        and 0 < max_m < 2**16
        and 0 < max_m0 < 2**16
        and (count == 0 or (max_level >= 0 and entry < count))
    ):
        raise ValueError("header.bin does not describe a float32 index of this dimension")
    data = np.fromfile(segment / "data_level0.bin", dtype=np.uint8)
    if data.size < count * per_element:
        raise ValueError(f"data_level0.bin has {data.size} bytes, not {count} elements'")
    if (segment / "length.bin").stat().st_size < count * 4:
        raise ValueError(f"length.bin is shorter than {count} elements")
    rows = data[: count * per_element].reshape(count, per_element)
    _check_lists(rows[:, :links0].copy().view(_ID), count, "data_level0.bin")
    labels = rows[:, label_offset:].copy().view("<u8")
    if len(np.unique(labels)) != count:
        raise ValueError("data_level0.bin repeats a label")
    levels, upper = _read_link_lists(segment / "link_lists.bin", count, max_m)
    if count and (levels.max() > max_level or levels[entry] != max_level):
        raise ValueError(f"link_lists.bin's levels disagree with the top level {max_level}")
    _check_lists(upper, count, "link_lists.bin")


def _read_link_lists(path: Path, count: int, max_m: int) -> tuple[np.ndarray, np.ndarray]:
    """Each element's level, and all upper-level link lists as rows of ``max_m + 1`` ids."""
    blob = path.read_bytes()
    per_level = (max_m + 1) * _ID.itemsize
    levels = np.zeros(count, dtype=np.int64)
    lists: list[bytes] = []
    position = 0
    for element in range(count):
        if position + 4 > len(blob):
            raise ValueError(f"link_lists.bin ends before element {element}")
        (size,) = struct.unpack_from("<I", blob, position)
        position += 4
        if size % per_level or position + size > len(blob):
            raise ValueError(f"link_lists.bin gives element {element} a bad size {size}")
        levels[element] = size // per_level
        lists.append(blob[position : position + size])
        position += size
    if position != len(blob):
        raise ValueError(f"link_lists.bin has {len(blob) - position} bytes past its lists")
    return levels, np.frombuffer(b"".join(lists), dtype=_ID).reshape(-1, max_m + 1)


def _check_lists(lists: np.ndarray, count: int, name: str) -> None:
    """Raise unless each row (a count, then ids) lists at most its width of ids below ``count``."""
    sizes = lists[:, 0] & 0xFFFF  # the high half carries the delete mark
    width = lists.shape[1] - 1
    used = np.arange(width) < np.minimum(sizes, width)[:, None]  # [rows, width]
    if (sizes > width).any() or (lists[:, 1:][used] >= count).any():
        raise ValueError(f"{name} links to elements that do not exist")


def lock_path(chroma_dir: Path) -> Path:
    """The lock file of a Chroma directory: ``<dir>.lock`` beside it."""
    return chroma_dir.with_name(chroma_dir.name + ".lock")


def hold(lock: Path) -> int | None:
    """Take a shared lock on ``lock`` (created if missing); it lasts until the returned
    descriptor is closed or the process ends.  ``None`` where ``fcntl`` is missing."""
    try:
        import fcntl
    except ImportError:
        return None
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def remove_unheld(chroma_dir: Path) -> bool:
    """Delete ``chroma_dir`` and its lock file unless some process holds the lock."""
    try:
        import fcntl
    except ImportError:
        return False
    lock = lock_path(chroma_dir)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # being built or used right now
        shutil.rmtree(chroma_dir, ignore_errors=True)
        if chroma_dir.exists():
            logger.warning("could not remove the unused Chroma directory %s", chroma_dir)
            return False
        lock.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)

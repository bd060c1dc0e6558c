"""Read one layer at a time from a disk entry's safetensors data file.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range (relative to the end of the header), then the bytes.
``k`` and ``v`` are ``[L, H_kv, n, D]`` and row-major, so layer ``l`` of each is one run of
``H_kv * n * D`` elements at ``begin + l * layer_bytes``.  :class:`LayerFile` opens the file
once (an open descriptor keeps reading the same file even if another process replaces or
evicts it meanwhile), checks the file's tensor table against the entry's verified JSON
header, and then reads a layer with positional reads straight into the caller's buffers,
verifying the layer's checksum (:func:`codec.check_layer`) before handing it over.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from chunkcache.core.store import codec
from chunkcache.core.store.codec import CorruptEntryError

_LENGTH = struct.Struct("<Q")
_MAX_TABLE = 1 << 20  # a k/v table is ~200 bytes; anything near this is not one
_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


class LayerFile:
    """The data file of one entry whose ``header`` passed :func:`codec.verify_header`.

    :meth:`read` fills layer ``l`` of ``k``/``v``; it raises :class:`CorruptEntryError` when
    the bytes fail their checksum or the file is shorter than its table says, and
    ``OSError`` when the disk fails.  The descriptor closes with :meth:`close` (or when the
    object is collected).
    """

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.header = header
        self.shape = [int(n) for n in header["shape"]]  # [L, H_kv, n, D]
        self.dtype = codec.dtype_of(header)
        self._fd = os.open(path, os.O_RDONLY)
        self._close = weakref.finalize(self, os.close, self._fd)
        self._lock = threading.Lock()
        try:
            self._offsets = self._table()
        except BaseException:
            self.close()
            raise

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer of k (or of v)."""
        _, heads, tokens, dim = self.shape
        return heads * tokens * dim * self.dtype.itemsize

    def read(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Read layer ``layer`` into ``k`` and ``v`` (contiguous CPU ``[H_kv, n, D]``), verified."""
        with self._lock:  # one reader at a time per descriptor; pread itself is positional
            for name, out in (("k", k), ("v", v)):
                buffer = out.view(torch.uint8).numpy().data
                offset = self._offsets[name] + layer * self.layer_bytes
                if os.preadv(self._fd, [buffer], offset) != self.layer_bytes:
                    raise CorruptEntryError(f"{name} layer {layer}: file shorter than its table")
        codec.check_layer(self.header, layer, k, v)

    def close(self) -> None:
        self._close()

    def _table(self) -> dict[str, int]:
        """The absolute file offset of ``k`` and ``v``, after checking dtype, shape, size."""
        raw = os.pread(self._fd, _LENGTH.size, 0)
        if len(raw) != _LENGTH.size:
            raise CorruptEntryError("data file too short")
        (length,) = _LENGTH.unpack(raw)
        if length > _MAX_TABLE:
            raise CorruptEntryError("data file table length out of range")
        size = os.fstat(self._fd).st_size
        if size != self.header["num_bytes"]:
            raise CorruptEntryError("data file size differs from the header")
        try:
            table = json.loads(os.pread(self._fd, length, _LENGTH.size))
            total = self.shape[0] * self.layer_bytes
            offsets = {}
            for name in ("k", "v"):
                entry = table[name]
                begin, end = (int(x) for x in entry["data_offsets"])
                if entry["dtype"] != _CODES.get(self.dtype) or entry["shape"] != self.shape:
                    raise CorruptEntryError(f"{name}: dtype or shape differs from the header")
                if end - begin != total:
                    raise CorruptEntryError(f"{name}: byte range does not fit its shape")
                # a garbled table's offsets would reach pread as numbers it cannot take
                if not 0 <= begin <= end <= size - _LENGTH.size - length:
                    raise CorruptEntryError(f"{name}: byte range outside the file")
                offsets[name] = _LENGTH.size + length + begin
        except CorruptEntryError:
            raise
        except (ValueError, KeyError, TypeError, OverflowError, UnicodeDecodeError) as error:
            raise CorruptEntryError(f"unreadable data file table: {error}") from error
        return offsets

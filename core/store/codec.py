"""What a stored chunk-KV entry is outside process memory: its key and its bytes.

Keys are hashes only (DESIGN: "a key never becomes a path from user text"): the model
fingerprint, the segment id and the context each become a 128-bit blake2b hex digest, and
every path or Redis key is made from those digests.  An entry is two parts:

- the *data*: a safetensors blob holding ``k`` and ``v`` (``[L, H_kv, n, D]``, so layer ``l``
  of each is one contiguous run of bytes that can be read alone);
- the *header*: JSON with the raw fingerprint, segment id and context (checked on read, so a
  hash collision or a file copied between namespaces is caught), start, exact, Cache-Craft
  metadata (:class:`CraftMeta` as JSON), the reuse counters, the tensors' dtype and shape,
  the format version, one blake2b checksum per layer (over that layer's k bytes, then its v
  bytes) and a ``checksum`` over every other header field.  The header checksum covers the
  layer checksums, so a verified header plus a verified layer is a verified part of the entry:
  a reader may check layer by layer as it reads (:func:`check_layer`), or all at once
  (:func:`decode`).

Format 2 added the per-layer checksums; format 3 keys chunks by id and token hash
(:func:`~chunkcache.core.chunk_ids.chunk_key`), so older entries, keyed by id alone, are
never looked up again and their directory is removed.  An entry of any other format fails
:func:`verify_header` (a corrupt entry, dropped, never served).  The disk tier keeps the two
parts in two files (the header written last, as the commit); the Redis tier keeps them in one
blob (:func:`pack`).  Nothing here is pickle.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from chunkcache.core.craft import CraftMeta
from chunkcache.core.kv_store import KVVariant, ReuseCount

FORMAT_VERSION = 3


class CorruptEntryError(Exception):
    """A stored entry failed verification: partial, bit-flipped, or not what its key says."""


@dataclass(frozen=True, order=True)
class EntryKey:
    """The hashed identity of one variant: namespace (fingerprint), segment and context."""

    namespace: str
    segment: str
    context: str

    @property
    def segment_key(self) -> tuple[str, str]:
        """What every variant of one segment (chunk) of one model shares."""
        return (self.namespace, self.segment)


def digest(text: str, domain: str) -> str:
    """A 128-bit blake2b hex digest of ``text`` in ``domain`` (safe as a file or key name)."""
    h = hashlib.blake2b(digest_size=16, person=domain.encode()[:16])
    h.update(text.encode())
    return h.hexdigest()


def namespace_of(fingerprint: str) -> str:
    """The hashed namespace of a model fingerprint: models never share entries."""
    return digest(fingerprint, "cc-fingerprint")


def segment_of(segment_id: str) -> str:
    """The hashed name of a prompt segment (a chunk id, or an id for a run of plain text)."""
    return digest(segment_id, "cc-segment")


def entry_key(fingerprint: str, segment_id: str, context: str) -> EntryKey:
    """The key of one variant: ``segment_id`` computed after ``context`` by one model."""
    return EntryKey(
        namespace_of(fingerprint), segment_of(segment_id), digest(context, "cc-context")
    )


def checksum(header: dict[str, Any]) -> str:
    """blake2b-256 over the header's other fields (canonical JSON), hex: a flipped byte in any
    field (start, exact, metadata, a layer checksum) is caught."""
    h = hashlib.blake2b(digest_size=32)
    h.update(header_bytes({k: v for k, v in header.items() if k != "checksum"}))
    return h.hexdigest()


def layer_checksum(k: Tensor, v: Tensor) -> str:
    """blake2b-128 over one layer's k bytes then v bytes (``[H_kv, n, D]`` each), hex."""
    h = hashlib.blake2b(digest_size=16)
    for t in (k, v):
        h.update(t.contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def encode(fingerprint: str, variant: KVVariant) -> tuple[bytes, dict[str, Any]]:
    """The data blob and the header of ``variant`` stored under ``fingerprint``."""
    k, v = (t.detach().cpu().contiguous() for t in (variant.k, variant.v))
    data = st_save({"k": k, "v": v})
    header = {
        "format": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "segment_id": variant.segment_id,
        "context": variant.context,
        "start": variant.start,
        "exact": variant.exact,
        "dtype": str(k.dtype).removeprefix("torch."),
        "shape": list(k.shape),
        "meta": variant.meta.to_json() if variant.meta is not None else None,
        "num_reuses": variant.reuse.num_reuses,
        "frequency_reuse": variant.reuse.frequency_reuse,
        "num_bytes": len(data),
        "layer_checksums": [layer_checksum(k[i], v[i]) for i in range(k.shape[0])],
    }
    header["checksum"] = checksum(header)
    return data, header


def verify_header(header: dict[str, Any], fingerprint: str, key: EntryKey) -> None:
    """Check ``header`` on its own and against ``key``: format, checksum, fingerprint,
    segment and context, a 4-d shape with one checksum per layer, a known dtype.

    Raises :class:`CorruptEntryError` on any mismatch.
    """
    try:
        if header.get("format") != FORMAT_VERSION:
            raise CorruptEntryError(f"format {header.get('format')!r}")
        if checksum(header) != header["checksum"]:
            raise CorruptEntryError("header checksum mismatch")
        if header["fingerprint"] != fingerprint:
            raise CorruptEntryError("entry belongs to another model fingerprint")
        if entry_key(fingerprint, header["segment_id"], header["context"]) != key:
            raise CorruptEntryError("entry does not match its key")
        shape = header["shape"]
        if len(shape) != 4 or len(header["layer_checksums"]) != shape[0]:
            raise CorruptEntryError(f"shape {shape} does not match its layer checksums")
        dtype_of(header)
    except CorruptEntryError:
        raise
    except Exception as error:  # a malformed header: same verdict
        raise CorruptEntryError(f"{type(error).__name__}: {error}") from error


def dtype_of(header: dict[str, Any]) -> torch.dtype:
    """The tensors' dtype a (verified) header names."""
    dtype = getattr(torch, str(header["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptEntryError(f"unknown dtype {header['dtype']!r}")
    return dtype


def check_layer(header: dict[str, Any], layer: int, k: Tensor, v: Tensor) -> None:
    """Raise :class:`CorruptEntryError` unless ``k``, ``v`` (``[H_kv, n, D]``) are layer
    ``layer`` of the entry a verified ``header`` describes."""
    if layer_checksum(k, v) != header["layer_checksums"][layer]:
        raise CorruptEntryError(f"layer {layer} checksum mismatch")


def variant_of(header: dict[str, Any], k: Tensor, v: Tensor) -> KVVariant:
    """The variant a verified ``header`` describes, holding ``k`` and ``v``."""
    fields = (str(header["segment_id"]), str(header["context"]), int(header["start"]))
    return KVVariant(*fields, bool(header["exact"]), k, v, meta_of(header), reuse_of(header))


def meta_of(header: dict[str, Any]) -> CraftMeta | None:
    """The Cache-Craft metadata a verified ``header`` holds."""
    return CraftMeta.from_json(header["meta"]) if header["meta"] is not None else None


def reuse_of(header: dict[str, Any]) -> ReuseCount:
    """The reuse counters a verified ``header`` holds."""
    return ReuseCount(int(header["num_reuses"]), float(header["frequency_reuse"]))


def decode(data: bytes, header: dict[str, Any], fingerprint: str, key: EntryKey) -> KVVariant:
    """Verify ``header`` and every layer of ``data``; the variant, on CPU.

    Raises :class:`CorruptEntryError` on any mismatch (:func:`verify_header`, a data size,
    shape, dtype or layer checksum that does not match).
    """
    verify_header(header, fingerprint, key)
    try:
        if len(data) != header["num_bytes"]:
            raise CorruptEntryError("data size mismatch")
        tensors = st_load(data)
        k, v = tensors["k"], tensors["v"]
        shape = list(header["shape"])
        if list(k.shape) != shape or list(v.shape) != shape:
            raise CorruptEntryError(f"shape {list(k.shape)} != {shape}")
        if k.dtype != dtype_of(header) or v.dtype != k.dtype:
            raise CorruptEntryError("dtype mismatch")
        for layer in range(shape[0]):
            check_layer(header, layer, k[layer], v[layer])
        return variant_of(header, k, v)
    except CorruptEntryError:
        raise
    except Exception as error:  # malformed blob: same verdict
        raise CorruptEntryError(f"{type(error).__name__}: {error}") from error


def header_bytes(header: dict[str, Any]) -> bytes:
    """An entry's header as stored: canonical JSON (sorted keys), never pickle."""
    return json.dumps(header, sort_keys=True).encode()


def parse_header(raw: bytes) -> dict[str, Any]:
    """A stored header read back; :class:`CorruptEntryError` unless a JSON object."""
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise CorruptEntryError(f"unreadable header: {error}") from error
    if not isinstance(header, dict):
        raise CorruptEntryError("header is not an object")
    return header


_LENGTH = struct.Struct("<Q")


def pack(data: bytes, header: dict[str, Any]) -> bytes:
    """One blob (for Redis): 8-byte header length, JSON header, safetensors data."""
    raw = header_bytes(header)
    return _LENGTH.pack(len(raw)) + raw + data


def unpack(blob: bytes) -> tuple[bytes, dict[str, Any]]:
    """The data and header of a :func:`pack` blob; :class:`CorruptEntryError` if malformed."""
    if len(blob) < _LENGTH.size:
        raise CorruptEntryError("blob too short")
    (length,) = _LENGTH.unpack_from(blob)
    if length > len(blob) - _LENGTH.size:
        raise CorruptEntryError("header length out of range")
    header = parse_header(blob[_LENGTH.size : _LENGTH.size + length])
    return blob[_LENGTH.size + length :], header

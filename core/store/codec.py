"""What a stored chunk-KV entry is outside process memory: its key and its bytes.

Keys are hashes only (DESIGN: "a key never becomes a path from user text"): the model
fingerprint, the segment id and the context each become a 128-bit blake2b hex digest, and
every path or Redis key is made from those digests.  An entry is two parts:

- the *data*: a safetensors blob holding ``k`` and ``v`` (``[L, H_kv, n, D]``);
- the *header*: JSON with the raw fingerprint, segment id and context (checked on read, so a
  hash collision or a file copied between namespaces is caught), start, exact, Cache-Craft
  metadata (:class:`CraftMeta` as JSON), the reuse counters, the tensors' dtype and shape,
  the format version and a blake2b checksum over the other header fields and the data.

The disk tier keeps the two parts in two files (the header written last, as the commit); the
Redis tier keeps them in one blob (:func:`pack`).  Nothing here is pickle.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from chunkcache.core.craft import CraftMeta
from chunkcache.core.kv_store import KVVariant, ReuseCount

FORMAT_VERSION = 1


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
        return (self.namespace, self.segment)


def digest(text: str, domain: str) -> str:
    """A 128-bit blake2b hex digest of ``text`` in ``domain`` (safe as a file or key name)."""
    h = hashlib.blake2b(digest_size=16, person=domain.encode()[:16])
    h.update(text.encode())
    return h.hexdigest()


def namespace_of(fingerprint: str) -> str:
    return digest(fingerprint, "cc-fingerprint")


def segment_of(segment_id: str) -> str:
    return digest(segment_id, "cc-segment")


def entry_key(fingerprint: str, segment_id: str, context: str) -> EntryKey:
    return EntryKey(
        namespace_of(fingerprint), segment_of(segment_id), digest(context, "cc-context")
    )


def checksum(data: bytes, header: dict[str, Any]) -> str:
    """blake2b-256 over the header's other fields (canonical JSON) and the data blob, hex:
    a flipped byte in the tensors or in any field (start, exact, metadata) is caught."""
    h = hashlib.blake2b(digest_size=32)
    h.update(header_bytes({k: v for k, v in header.items() if k != "checksum"}))
    h.update(data)
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
        "dtype": str(variant.k.dtype).removeprefix("torch."),
        "shape": list(variant.k.shape),
        "meta": variant.meta.to_json() if variant.meta is not None else None,
        "num_reuses": variant.reuse.num_reuses,
        "frequency_reuse": variant.reuse.frequency_reuse,
        "num_bytes": len(data),
    }
    header["checksum"] = checksum(data, header)
    return data, header


def decode(data: bytes, header: dict[str, Any], fingerprint: str, key: EntryKey) -> KVVariant:
    """Verify ``data`` against ``header`` and both against ``key``; the variant, on CPU.

    Raises :class:`CorruptEntryError` on any mismatch: wrong version, another fingerprint,
    another segment or context than the key, a checksum or shape that does not match.
    """
    try:
        if header.get("format") != FORMAT_VERSION:
            raise CorruptEntryError(f"format {header.get('format')!r}")
        if header["fingerprint"] != fingerprint:
            raise CorruptEntryError("entry belongs to another model fingerprint")
        if entry_key(fingerprint, header["segment_id"], header["context"]) != key:
            raise CorruptEntryError("entry does not match its key")
        if len(data) != header["num_bytes"] or checksum(data, header) != header["checksum"]:
            raise CorruptEntryError("checksum mismatch")
        tensors = st_load(data)
        k, v = tensors["k"], tensors["v"]
        shape = list(header["shape"])
        if list(k.shape) != shape or list(v.shape) != shape or len(shape) != 4:
            raise CorruptEntryError(f"shape {list(k.shape)} != {shape}")
        if str(k.dtype).removeprefix("torch.") != header["dtype"]:
            raise CorruptEntryError("dtype mismatch")
        meta = CraftMeta.from_json(header["meta"]) if header["meta"] is not None else None
        reuse = ReuseCount(int(header["num_reuses"]), float(header["frequency_reuse"]))
        return KVVariant(
            str(header["segment_id"]),
            str(header["context"]),
            int(header["start"]),
            bool(header["exact"]),
            k,
            v,
            meta,
            reuse,
        )
    except CorruptEntryError:
        raise
    except Exception as error:  # malformed header or blob: same verdict
        raise CorruptEntryError(f"{type(error).__name__}: {error}") from error


def header_bytes(header: dict[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True).encode()


def parse_header(raw: bytes) -> dict[str, Any]:
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

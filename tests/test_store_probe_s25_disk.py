"""The disk tier under faults the other disk tests do not make: a disk whose ``stat`` fails
(EIO, EACCES, an NFS ESTALE) and a data file whose tensor table is garbled."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
from test_store_support import FP, make_variant, same_kv

from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore, entry_key
from chunkcache.core.store.disk import LAYOUT


def test_a_disk_whose_stat_fails_never_fails_a_put_or_a_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host evicting ``a`` asks the disk whether it holds a copy.  A disk that cannot
    answer holds none: ``a`` is demoted as usual.  (It used to raise out of the host's
    put midway: ``a`` gone from the host and never demoted, ``b`` never put there, and the
    disk's failure counted as the host's.)"""
    a, b = make_variant("a"), make_variant("b", seed=1)
    store = TieredKVStore([MemoryTier("host", a.num_bytes), DiskTier(tmp_path, 10**6)])
    store.put(FP, a)
    stat, failing = os.stat, str(tmp_path / LAYOUT)

    def eio(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if str(path).startswith(failing):
            raise OSError(errno.EIO, "Input/output error", str(path))
        return stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", eio)
    store.put(FP, b)  # evicts a from the host
    assert store.metrics()["tiers"]["host"]["errors"] == 0
    assert same_kv(store.tiers[0].get(entry_key(FP, "b", "root"), FP), b)
    assert same_kv(store.exact(FP, "a", "root"), a)


def garble_table(data: Path, offsets: str) -> None:
    """Rewrite the safetensors table of ``data`` with k's ``data_offsets`` replaced by the
    JSON text ``offsets``, keeping the file's size (so only the table is wrong)."""
    raw = data.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    table = json.loads(raw[8 : 8 + length])
    text = json.dumps(table).replace(json.dumps(table["k"]["data_offsets"]), offsets).encode()
    garbled = struct.pack("<Q", len(text)) + text + raw[8 + length :]
    data.write_bytes(garbled[: len(raw)].ljust(len(raw), b"\0"))


@pytest.mark.parametrize(
    "offsets", ["[1e400, 1e400]", f"[{2**70}, {2**70 + 64}]", f"[{-(2**70)}, {-(2**70) + 64}]"]
)
def test_a_garbled_tensor_table_is_a_corrupt_entry_not_a_crash(
    tmp_path: Path, offsets: str
) -> None:
    """A layer read lazily goes by the data file's own table: numbers pread cannot take
    (infinite, past the file, negative) make the entry corrupt, a miss."""
    a = make_variant("a", num_tokens=2)  # k: 2 layers x 32 bytes
    TieredKVStore([DiskTier(tmp_path, 10**6)]).put(FP, a)
    (data,) = (tmp_path / LAYOUT).rglob("*.safetensors")
    garble_table(data, offsets)
    store = TieredKVStore([MemoryTier("host", 10**6), DiskTier(tmp_path, 10**6)])
    assert store.variants(FP, "a") == []
    assert store.metrics()["corrupt_dropped"] == 1
    TieredKVStore([DiskTier(tmp_path, 10**6)]).put(FP, a)  # recomputed and stored again
    (got,) = TieredKVStore([MemoryTier("host", 10**6), DiskTier(tmp_path, 10**6)]).variants(FP, "a")
    assert same_kv(got, a)

"""The disk tier leaves no folder per segment it ever held (s28 leak probe).

Writing an entry creates ``v3/<ns>/<seg[:2]>/<seg>/``; removing it unlinked its two files
only, so one empty folder stayed per segment ever written: an inode and a block each, and
every rescan (after another process's write, under the lock) walked them all.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_store_support import FP, make_variant, same_kv

from chunkcache.core.kv_store import ROOT_CONTEXT
from chunkcache.core.store import DiskTier, disk
from chunkcache.core.store.codec import EntryKey, entry_key
from chunkcache.core.store.tier import Loader

CAPACITY = 10**6


def no_victim(keys: list[EntryKey]) -> EntryKey:
    raise AssertionError("nothing should be evicted")


def no_eviction(key: EntryKey, loader: Loader) -> None:
    raise AssertionError("nothing should be evicted")


def put(tier: DiskTier, segment_id: str) -> EntryKey:
    key = entry_key(FP, segment_id, ROOT_CONTEXT)
    assert tier.put(key, FP, make_variant(segment_id), no_victim, no_eviction)
    return key


def folders(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_dir())


def test_removing_entries_removes_their_segment_folders(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, CAPACITY)
    keys = [put(tier, f"segment-{i}") for i in range(20)]
    for key in keys:
        tier.remove(key)
    # the layout folder and the namespace's: nothing per segment
    assert folders(tmp_path) == [tier.data_root, tier.data_root / keys[0].namespace]


def test_a_folder_another_entry_still_uses_stays(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, CAPACITY)
    first = put(tier, "segment")
    other = entry_key(FP, "segment", "some context")
    assert tier.put(other, FP, make_variant("segment", "some context"), no_victim, no_eviction)
    tier.remove(first)
    assert tier.get(other, FP) is not None and len(tier) == 1


def test_a_write_whose_folder_a_concurrent_removal_took_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``prepare`` makes the folder and writes its temp files without the lock: another
    thread or process removing the folder's last entry in between takes the folder too."""
    tier = DiskTier(tmp_path, CAPACITY)
    write_temp = disk._write_temp
    raced: list[Path] = []

    def folder_taken_first(final: Path, payload: bytes) -> Path:
        if not raced:
            raced.append(final)
            final.parent.rmdir()
        return write_temp(final, payload)

    monkeypatch.setattr(disk, "_write_temp", folder_taken_first)
    key, variant = entry_key(FP, "segment", ROOT_CONTEXT), make_variant("segment")
    assert tier.put(key, FP, variant, no_victim, no_eviction)
    assert raced and same_kv(tier.get(key, FP), variant)


def test_open_removes_empty_entry_folders_and_nothing_else(tmp_path: Path) -> None:
    """Folders an older run left empty go at the next open; the directory may be shared,
    so a folder of another shape, or holding another's file, stays."""
    tier = DiskTier(tmp_path, CAPACITY)
    key = put(tier, "kept")
    ns = tier.data_root / key.namespace
    seg = "ab" + "0" * 30
    (ns / "ab" / seg).mkdir(parents=True)  # what an older run left
    foreign_empty = [ns / "cd" / "not-a-segment", tier.data_root / "theirs", tmp_path / "x"]
    for folder in foreign_empty:
        folder.mkdir(parents=True)
    holding = ns / "ef" / ("ef" + "1" * 30)
    holding.mkdir(parents=True)
    (holding / "notes.txt").write_text("someone else's")

    reopened = DiskTier(tmp_path, CAPACITY)
    assert not (ns / "ab").exists()
    assert all(folder.is_dir() for folder in foreign_empty)
    assert (holding / "notes.txt").read_text() == "someone else's"
    assert reopened.get(key, FP) is not None

"""The disk tier touches only files of its own shape in a directory it shares.

An operator may point ``disk_dir`` (``CHUNKCACHE_STORE_DISK_DIR``) at a folder that holds
other things; the tier must never delete, count or evict a file it could not have written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from test_store_support import FP, make_variant, same_kv

from chunkcache.core.store import DiskTier, TieredKVStore
from chunkcache.core.store.disk import LAYOUT


def _store(root: Path, capacity: int = 10_000_000) -> TieredKVStore:
    return TieredKVStore([DiskTier(root, capacity)])


def test_folders_named_like_an_old_format_keep_someone_elses_files(tmp_path: Path) -> None:
    """Opening the tier removed every ``v1``/``v2`` folder in its directory whole."""
    _store(tmp_path).put(FP, make_variant("a"))
    old_entries = tmp_path / "v2"
    shutil.copytree(tmp_path / LAYOUT, old_entries)  # an older version's (same shape)
    (old_entries / "README.md").write_text("kept")  # someone's file beside them
    theirs = tmp_path / "v1" / "reports" / "q3.csv"
    theirs.parent.mkdir(parents=True)
    theirs.write_text("important")

    store = _store(tmp_path)

    assert theirs.read_text() == "important"
    assert (old_entries / "README.md").read_text() == "kept"
    left = sorted(p.relative_to(old_entries) for p in old_entries.rglob("*"))
    assert left == [Path("README.md")]  # the old entries and their folders went
    assert same_kv(store.exact(FP, "a", "root"), make_variant("a"))


def test_an_old_format_folder_of_only_entries_goes(tmp_path: Path) -> None:
    _store(tmp_path).put(FP, make_variant("a"))
    shutil.copytree(tmp_path / LAYOUT, tmp_path / "v1")
    _store(tmp_path)
    assert not (tmp_path / "v1").exists()


def test_foreign_files_in_the_layout_are_not_entries(tmp_path: Path) -> None:
    """A file at an entry's depth but not of an entry's name is neither swept as an orphan,
    nor counted against the capacity, nor evicted."""
    foreign = tmp_path / LAYOUT / "notes" / "2024" / "q3" / "summary.json"
    foreign.parent.mkdir(parents=True)
    foreign.write_bytes(b"{}" * 1000)
    store = _store(tmp_path, capacity=3000)
    tier = store.tiers[0]
    assert foreign.exists()
    assert (len(tier), tier.num_bytes) == (0, 0)
    for name in "abc":
        store.put(FP, make_variant(name))
    assert foreign.exists()

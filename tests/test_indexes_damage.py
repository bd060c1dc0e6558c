"""Damage to Chroma's HNSW link lists, and the ``chroma-*`` directories killed builds leave.

Embeddings are random unit vectors (``embed_calls``), so no model loads."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from test_indexes import _approx, _closed_chroma_dir, _empty, _hits, _truncate, embed_calls

from chunkcache.core.corpus import load_corpus
from chunkcache.integrations import indexes
from chunkcache.integrations.chroma_files import hold, lock_path

__all__ = ["embed_calls"]  # the fixture, imported for these tests


def _zero(path: Path) -> None:
    """The same size, every byte 0: before the check, Chroma crashed on the next query."""
    path.write_bytes(bytes(path.stat().st_size))


def _link_out_of_range(path: Path) -> None:
    """The first upper-level link in the file pointed at an element that does not exist."""
    data = bytearray(path.read_bytes())
    position = 0
    while True:  # each element: its lists' size in bytes, then the lists (a count, then ids)
        assert position < len(data), "no element has an upper-level link to damage"
        size = int.from_bytes(data[position : position + 4], "little")
        if size and int.from_bytes(data[position + 4 : position + 6], "little"):
            break
        position += 4 + size
    data[position + 8 : position + 12] = (2**31).to_bytes(4, "little")
    path.write_bytes(bytes(data))


@pytest.mark.usefixtures("embed_calls")
@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(_truncate, id="truncated"),
        pytest.param(_empty, id="empty"),
        pytest.param(_zero, id="zeroed"),
        pytest.param(_link_out_of_range, id="link-out-of-range"),
    ],
)
def test_damaged_hnsw_link_lists_are_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Callable[[Path], None]
) -> None:
    chunks = load_corpus()  # enough chunks for Chroma to write its HNSW files
    built = indexes._CorpusIndexes(chunks, tmp_path)
    expected = _approx(_hits(built))
    chroma_dir = _closed_chroma_dir(built)
    damage(next(chroma_dir.rglob("link_lists.bin")))

    rebuilt = indexes._CorpusIndexes(chunks, tmp_path)
    with caplog.at_level(logging.WARNING, logger=indexes.__name__):
        assert _hits(rebuilt) == expected
    warnings = [record.getMessage() for record in caplog.records]
    assert any(
        f"rebuilding damaged Chroma index {chroma_dir}: HNSW segment" in w and "link_lists" in w
        for w in warnings
    ), warnings
    assert not chroma_dir.exists()

    caplog.clear()
    _closed_chroma_dir(rebuilt)
    with caplog.at_level(logging.WARNING, logger=indexes.__name__):
        assert _hits(indexes._CorpusIndexes(chunks, tmp_path)) == expected
    assert not caplog.records  # the rebuilt files pass the check


def _python(code: str) -> subprocess.Popen[str]:
    """Run ``code`` in another Python process (stdin and stdout are pipes)."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _killed_build(corpus_indexes: indexes._CorpusIndexes) -> Path:
    """The directory a build left when its process was killed (SIGKILL) after filling it."""
    child = _python(
        f"""
        import os, signal
        from pathlib import Path
        import numpy as np
        from chunkcache.core.corpus import load_corpus
        from chunkcache.integrations import indexes

        def fill_then_die(self, *args):
            fill(self, *args)
            os.kill(os.getpid(), signal.SIGKILL)

        fill = indexes._CorpusIndexes._fill
        indexes._CorpusIndexes._fill = fill_then_die
        root = Path({str(corpus_indexes.directory.parent)!r})
        built = indexes._CorpusIndexes(load_corpus(max_chunks=12), root)
        built._build_chroma(np.load(built.directory / "embeddings.npy"))
        """
    )
    child.communicate()
    assert child.returncode == -9
    current = corpus_indexes._current_chroma_path()
    (left,) = [p for p in corpus_indexes.directory.glob("chroma-*") if p.is_dir() and p != current]
    assert (left / "chroma.sqlite3").is_file()
    return left


@pytest.mark.usefixtures("embed_calls")
def test_directories_of_killed_builds_are_removed_unless_held(tmp_path: Path) -> None:
    chunks = load_corpus(max_chunks=12)
    built = indexes._CorpusIndexes(chunks, tmp_path)
    expected = _approx(_hits(built))
    current = _closed_chroma_dir(built)
    killed = _killed_build(built)
    old = built.directory / "chroma-oldversion"  # left by a version without lock files
    (old / "segment").mkdir(parents=True)
    in_use = built.directory / "chroma-inuse"  # another process builds or reads it now
    in_use.mkdir()
    holder = _python(
        f"""
        import sys
        from pathlib import Path
        from chunkcache.integrations.chroma_files import hold, lock_path

        hold(lock_path(Path({str(in_use)!r})))
        print("held", flush=True)
        sys.stdin.read()  # until the test closes stdin
        """
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    try:
        assert _hits(indexes._CorpusIndexes(chunks, tmp_path)) == expected
        assert current.is_dir() and in_use.is_dir()  # the current one, and one still held
        assert not killed.exists() and not lock_path(killed).exists()
        assert not old.exists() and not lock_path(old).exists()
    finally:
        holder.communicate()  # closes stdin: the holder ends, its lock with it

    in_this_process = built.directory / "chroma-inthisprocess"  # e.g. another thread's
    in_this_process.mkdir()
    held = hold(lock_path(in_this_process))
    assert held is not None
    try:
        assert _hits(indexes._CorpusIndexes(chunks, tmp_path)) == expected
    finally:
        os.close(held)
    left = sorted(p.name for p in built.directory.iterdir() if p.is_dir())
    assert left == sorted([current.name, in_this_process.name])  # in_use went with its holder


@pytest.mark.usefixtures("embed_calls")
def test_lone_lock_files_and_a_replaced_legacy_index_go_once_unheld(tmp_path: Path) -> None:
    chunks = load_corpus(max_chunks=12)
    built = indexes._CorpusIndexes(chunks, tmp_path)
    expected = _approx(_hits(built))
    current = _closed_chroma_dir(built)
    lone = built.directory / "chroma-killedbeforemkdir.lock"  # a build killed that early
    lone.touch()
    legacy = built.directory / "chroma"  # where earlier versions built, replaced since
    (legacy / "segment").mkdir(parents=True)
    held = hold(lock_path(legacy))  # a process of this version that opened it before
    assert held is not None
    try:
        _closed_chroma_dir(indexes._CorpusIndexes(chunks, tmp_path))
        assert not lone.exists()
        assert legacy.is_dir()
    finally:
        os.close(held)
    assert _hits(indexes._CorpusIndexes(chunks, tmp_path)) == expected
    assert not legacy.exists() and not lock_path(legacy).exists()
    left = sorted(p.name for p in built.directory.glob("chroma*"))
    assert left == sorted(["chroma.current", current.name, lock_path(current).name])


@pytest.mark.usefixtures("embed_calls")
def test_a_damaged_index_another_process_uses_is_left_to_it(tmp_path: Path) -> None:
    chunks = load_corpus(max_chunks=12)
    built = indexes._CorpusIndexes(chunks, tmp_path)
    expected = _approx(_hits(built))
    damaged = _closed_chroma_dir(built)
    _truncate(damaged / "chroma.sqlite3")
    held = hold(lock_path(damaged))  # as a process that opened it before the damage holds it
    assert held is not None
    try:
        rebuilt = indexes._CorpusIndexes(chunks, tmp_path)
        assert _hits(rebuilt) == expected
        assert damaged.is_dir()  # not pulled from under its user
        assert rebuilt._current_chroma_path() != damaged
    finally:
        os.close(held)
    _closed_chroma_dir(rebuilt)
    assert _hits(indexes._CorpusIndexes(chunks, tmp_path)) == expected
    assert not damaged.exists() and not lock_path(damaged).exists()  # gone with its user


@pytest.mark.usefixtures("embed_calls")
def test_index_files_get_the_mode_the_umask_gives_new_files(tmp_path: Path) -> None:
    """Temporary files are created 0600; replacing the index's files with them left a
    shared cache unreadable (and its locks unopenable) by every other account."""
    old = os.umask(0o002)  # a team's shared cache: group-writable
    try:
        built = indexes._CorpusIndexes(load_corpus()[:40], tmp_path)
        _hits(built)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in built.directory.iterdir() if p.is_file()}
    assert {"embeddings.npy", "ids.json", "faiss.index", "chroma.current"} <= set(modes)
    assert set(modes.values()) == {0o664}, modes

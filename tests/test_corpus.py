"""The bundled stdlib docstring corpus: content, chunk bounds, balance and its cache."""

import sys
from pathlib import PurePosixPath

import pytest

from chunkcache.core.chunk_ids import chunk_id
from chunkcache.core.corpus import (
    DEFAULT_MAX_CHUNKS,
    FORMAT_VERSION,
    MIN_CHUNK_CHARS,
    MIN_DOC_CHARS,
    SKIPPED_NAMES,
    corpus_cache_path,
    extract_corpus,
    load_corpus,
    topics,
)


@pytest.fixture(scope="module")
def full_corpus():
    return load_corpus(max_chunks=None)


def test_cached_corpus_equals_a_fresh_extraction(full_corpus):
    assert load_corpus(max_chunks=None) == full_corpus
    assert extract_corpus() == full_corpus


@pytest.fixture(scope="module")
def small_chunks():
    return extract_corpus(chunk_chars=400)


def test_chunks_are_self_contained_and_within_bounds(full_corpus, small_chunks):
    for chunk_chars, chunks in [(1000, full_corpus), (400, small_chunks)]:
        assert len(chunks) > 1000
        for chunk in chunks:
            assert MIN_DOC_CHARS <= len(chunk.text) <= chunk_chars
            title, _, body = chunk.text.partition("\n")
            assert title == chunk.title and body.strip()
            assert chunk.title.split(".")[0] == chunk.topic
            assert chunk.chunk_id == chunk_id(chunk.text)
        assert len({chunk.chunk_id for chunk in chunks}) == len(chunks)


def test_smaller_chunks_make_more_of_them(full_corpus, small_chunks):
    assert len(small_chunks) > 1.5 * len(full_corpus)


def test_known_docstrings_are_titled_by_their_qualified_name(full_corpus):
    dumps = [chunk for chunk in full_corpus if chunk.title == "json.dumps"]
    assert {(chunk.topic, chunk.source) for chunk in dumps} == {("json", "json/__init__.py")}
    assert "Serialize ``obj`` to a JSON formatted ``str``" in dumps[0].text
    titles = {chunk.title: chunk.source for chunk in full_corpus}
    assert titles["os"] == "os.py"
    assert titles["collections.Counter"] == "collections/__init__.py"


def test_tests_gui_and_private_modules_are_skipped(full_corpus):
    for chunk in full_corpus:
        parts = PurePosixPath(chunk.source).with_suffix("").parts
        assert not any(part in SKIPPED_NAMES for part in parts), chunk.source
        assert not any(part.startswith("_") and part != "__init__" for part in parts)
        assert not any(part.startswith("_") for part in chunk.title.split("."))


def test_default_cap_covers_every_topic_evenly(full_corpus):
    chunks = load_corpus()
    assert len(chunks) == min(DEFAULT_MAX_CHUNKS, len(full_corpus))
    grouped = topics(chunks)
    assert grouped.keys() == topics(full_corpus).keys()
    assert len(grouped) >= 100
    assert max(map(len, grouped.values())) <= 4 * len(chunks) / len(grouped)
    positions = {chunk.chunk_id: i for i, chunk in enumerate(full_corpus)}
    assert [positions[chunk.chunk_id] for chunk in chunks] == sorted(
        positions[chunk.chunk_id] for chunk in chunks
    )


def test_a_tiny_cap_takes_one_chunk_per_topic():
    chunks = load_corpus(max_chunks=10)
    assert len(chunks) == 10
    assert len(topics(chunks)) == 10


def test_topics_groups_in_corpus_order(full_corpus):
    grouped = topics(full_corpus)
    assert [chunk for group in grouped.values() for chunk in group] == sorted(
        full_corpus, key=lambda chunk: list(grouped).index(chunk.topic)
    )
    assert all(chunk.topic == topic for topic, group in grouped.items() for chunk in group)


def test_invalid_arguments_are_refused():
    with pytest.raises(ValueError):
        load_corpus(chunk_chars=MIN_CHUNK_CHARS - 1)
    with pytest.raises(ValueError):
        load_corpus(max_chunks=0)


def test_cache_file_names_python_format_and_size():
    name = corpus_cache_path(1000).name
    version = ".".join(map(str, sys.version_info[:3]))
    assert f"py{version}" in name and f"v{FORMAT_VERSION}" in name and "c1000" in name


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _drop_last_line(data: bytes) -> bytes:
    return b"".join(data.splitlines(keepends=True)[:-1])


def _flip_a_body_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return (
        data[:middle] + (b"X" if data[middle : middle + 1] != b"X" else b"Y") + data[middle + 1 :]
    )


@pytest.fixture(scope="module")
def built_cache(full_corpus, tmp_path_factory):
    """A home holding a freshly built cache file, and that file's bytes."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CHUNKCACHE_HOME", str(home))
        assert load_corpus(max_chunks=None) == full_corpus
        return home, corpus_cache_path().read_bytes()


@pytest.mark.parametrize(
    "corrupt",
    [_truncate, _drop_last_line, _flip_a_body_byte, lambda _: b"\x00garbage"],
    ids=["truncated", "last-line-dropped", "byte-flipped", "garbage"],
)
def test_corrupt_cache_is_rebuilt(corrupt, built_cache, full_corpus, monkeypatch):
    home, pristine = built_cache
    monkeypatch.setenv("CHUNKCACHE_HOME", str(home))
    path = corpus_cache_path()
    assert path.is_relative_to(home)
    path.write_bytes(corrupt(pristine))
    assert load_corpus(max_chunks=None) == full_corpus
    assert path.read_bytes() == pristine

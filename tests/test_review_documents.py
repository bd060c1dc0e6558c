"""Documents in, end to end: a user's folder with bad and odd files, its index, and its
chunks found again in a prompt built from them.

Each bad file is either skipped with a warning naming it (empty, binary, a broken
symlink, a folder already read) or refused with an error naming it (another encoding,
unreadable); the good files beside it are kept.
"""

from __future__ import annotations

import os
import tracemalloc
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from langchain_core.messages import HumanMessage
from test_bench_user_corpus import _collection
from tiny_models import tiny_lm, tiny_tokenizer

from chunkcache.core.cache import ChunkCache
from chunkcache.core.chunk_ids import check_unicode, chunk_id
from chunkcache.core.corpus import CorpusChunk, _split_words, split_section
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.errors import InvalidTextError, PromptTooLongError
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.user_corpus import (
    UserCorpusError,
    load_chroma_corpus,
    load_questions,
    load_text_folder,
)
from chunkcache.integrations import indexes
from chunkcache.integrations.embeddings import EMBEDDING_DIM, embed_texts
from chunkcache.integrations.indexes import langchain_chunks_retriever
from chunkcache.integrations.langchain import ChunkCacheLLM, ChunkCacheRetriever

GOOD = "A good neighbour: its text must never be lost because of a bad file beside it."


def _load(folder: Path) -> tuple[list[CorpusChunk], list[str]]:
    """The folder's chunks and the warnings loading it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chunks = load_text_folder(folder, chunk_chars=300)
    return chunks, [str(w.message) for w in caught]


def _texts_of(chunks: Sequence[CorpusChunk], title: str) -> list[str]:
    return [c.text.split("\n", 1)[1] for c in chunks if c.title == title]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "good.txt").write_text(GOOD, encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize(
    "encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-8-sig"]
)
def test_a_file_with_a_byte_order_mark_is_read_in_its_encoding(folder: Path, encoding: str):
    text = "Notes saved by Notepad as Unicode: café, 日本語, emoji 🧪."
    bom = {"utf-16-le": "\ufeff", "utf-16-be": "\ufeff", "utf-32-le": "\ufeff"}.get(encoding, "")
    (folder / "notes.txt").write_bytes((bom + text).encode(encoding))
    chunks, warned = _load(folder)
    assert _texts_of(chunks, "notes.txt") == [text] and not warned
    assert _texts_of(chunks, "good.txt") == [GOOD]
    questions = folder / "questions.txt"
    questions.write_bytes("\ufeffWho wrote it?\r\nWhen?".encode("utf-16-le"))
    assert [q.question for q in load_questions(questions)] == ["Who wrote it?", "When?"]


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"abc\x00def: a NUL byte in otherwise fine text", id="nul"),
        pytest.param("UTF-16 without its mark".encode("utf-16-le"), id="utf-16-no-bom"),
        pytest.param(bytes(range(256)) * 4, id="binary"),
    ],
)
def test_a_binary_file_is_skipped_with_a_warning_naming_it(folder: Path, data: bytes):
    (folder / "blob.md").write_bytes(data)
    chunks, warned = _load(folder)
    assert [c.title for c in chunks] == ["good.txt"]
    assert len(warned) == 1 and "blob.md: binary, it holds NUL bytes" in warned[0]
    (folder / "good.txt").unlink()
    with pytest.warns(UserWarning), pytest.raises(UserCorpusError, match="empty or binary"):
        load_text_folder(folder)
    with pytest.raises(UserCorpusError, match=r"blob\.md: binary"):
        load_questions(folder / "blob.md")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("Café crème".encode("latin-1"), r"latin1\.txt is not UTF-8 \(byte 3"),
        (b"lone \xed\xa0\x80 surrogate", r"latin1\.txt is not UTF-8 \(byte 5"),
        (
            b"\xff\xfeodd",
            r"latin1\.txt is not UTF-16 \(byte 4: truncated data\); its byte-order mark",
        ),
    ],
)
def test_a_file_in_another_encoding_is_refused_by_name(folder: Path, data: bytes, message: str):
    (folder / "latin1.txt").write_bytes(data)
    with pytest.raises(UserCorpusError, match=message):
        load_text_folder(folder)


def test_line_ends_do_not_change_the_chunks(tmp_path: Path):
    paragraphs = ["First line\nsecond line of one paragraph.", "A second paragraph. " * 14]
    folders = {}
    for name, end in [("lf", "\n"), ("crlf", "\r\n"), ("cr", "\r")]:
        folders[name] = tmp_path / name
        folders[name].mkdir()
        text = (end + end).join(p.replace("\n", end) for p in paragraphs)
        (folders[name] / "doc.txt").write_bytes(text.encode())
    chunks = {name: load_text_folder(path, chunk_chars=300) for name, path in folders.items()}
    assert chunks["crlf"] == chunks["lf"] == chunks["cr"]
    assert len(chunks["cr"]) == 2  # split at the paragraph break, as with "\n"


def test_symlinks_are_followed_and_loops_and_broken_links_skipped(tmp_path: Path):
    corpus, outside = tmp_path / "corpus", tmp_path / "outside"
    (corpus / "sub").mkdir(parents=True)
    outside.mkdir()
    (corpus / "sub" / "a.txt").write_text(GOOD, encoding="utf-8")
    (outside / "shared.md").write_text("Notes kept in another folder, linked in.", "utf-8")
    (corpus / "linked").symlink_to(outside, target_is_directory=True)
    (corpus / "sub" / "loop").symlink_to(corpus, target_is_directory=True)
    (corpus / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    chunks, warned = _load(corpus)
    assert [c.title for c in chunks] == ["linked/shared.md", "sub/a.txt"]
    assert [c.topic for c in chunks] == ["linked", "sub"]
    assert len(warned) == 2
    assert "broken symlink" in warned[0] and "gone.txt" in warned[0]
    assert "sub/loop" in warned[1] and "read already" in warned[1]


def test_an_unreadable_file_or_folder_is_refused_by_name(
    folder: Path, monkeypatch: pytest.MonkeyPatch
):
    # Permissions do not stop root, so the OS's refusal is simulated.
    (folder / "locked").mkdir()
    (folder / "locked" / "x.txt").write_text(GOOD, encoding="utf-8")
    scandir = os.scandir

    def refusing_scandir(path: Any = ".") -> Any:
        if Path(path).name == "locked":
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing_scandir)
    with pytest.raises(UserCorpusError, match=r"cannot read folder .*locked: Permission denied"):
        load_text_folder(folder)
    monkeypatch.undo()

    read_bytes = Path.read_bytes

    def refusing_read(path: Path) -> bytes:
        if path.name == "x.txt":
            raise PermissionError(13, "Permission denied", str(path))
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", refusing_read)
    with pytest.raises(UserCorpusError, match=r"cannot read .*x\.txt: Permission denied"):
        load_text_folder(folder)


def test_a_file_name_that_is_not_utf8_gives_a_readable_title(folder: Path):
    try:
        (folder / os.fsdecode(b"caf\xe9.txt")).write_text("Latin-1 file name.", "utf-8")
    except (OSError, UnicodeError):
        pytest.skip("the file system refuses a name that is not UTF-8")
    chunks, _ = _load(folder)
    named = next(c for c in chunks if c.title != "good.txt")
    assert named.title == "caf\ufffd.txt" and named.topic == "caf\ufffd"
    check_unicode(named.text)  # no lone surrogate: a tokenizer and an index accept it


def test_embed_texts_names_a_text_that_is_not_valid_unicode():
    with pytest.raises(InvalidTextError, match=r"text 1: .*\\ud83d at character 5"):
        embed_texts(["fine", "half \ud83d of an emoji"])
    with pytest.raises(TypeError, match="text 0 must be str, got bytes"):
        embed_texts([b"bytes"])  # type: ignore[list-item]


def test_a_long_line_is_split_without_copying_the_rest():
    """A 2 MB line without a sentence end: each piece copies a window, not the rest of the
    line (which took 15 s for 20 MB)."""
    text = " ".join(f"w{i}" for i in range(300_000))
    tracemalloc.start()
    try:
        for _ in _split_words(text, 900):
            pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < len(text) // 20


@pytest.mark.parametrize("separator", [" ", "\n", "\t"])
def test_a_long_line_is_cut_between_words(separator: str):
    words = [f"word{i}" for i in range(500)]
    pieces = list(split_section("t", "   " + separator.join(words), 200))
    bodies = [piece.removeprefix("t\n") for _, piece in pieces]
    assert all(len(piece) <= 200 for _, piece in pieces)
    assert [w for body in bodies for w in body.split()] == words  # no word cut, none lost
    assert all(body == body.strip() and body for body in bodies)


def test_a_20_mb_file_is_chunked_whole(folder: Path):
    words = [f"w{i}" for i in range(2_500_000)]
    (folder / "big.txt").write_text("\n".join(words), encoding="utf-8")  # one paragraph
    chunks = load_text_folder(folder)
    bodies = _texts_of(chunks, "big.txt")
    assert all(len(c.text) <= 1000 for c in chunks)
    assert [w for body in bodies for w in body.split()] == words
    assert _texts_of(chunks, "good.txt") == [GOOD]


def test_a_chroma_collection_with_repeated_texts_gives_each_chunk_once(tmp_path: Path):
    text = "The same document stored twice in the user's collection."
    entries = [
        ("b", text, {"title": "second"}),
        ("a", text, {"title": "first"}),
        ("c", "Another document.", {"n": 1}),
    ]
    _collection(tmp_path, entries=entries)
    chunks = load_chroma_corpus(tmp_path, "notes")
    assert [(c.source, c.title) for c in chunks] == [("a", "first"), ("c", "c")]


def _fake_embed(texts: Sequence[str]) -> np.ndarray:
    vectors = np.random.default_rng(len(texts)).standard_normal((len(texts), EMBEDDING_DIM))
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def test_an_index_over_chunks_with_repeated_ids_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path))
    monkeypatch.setattr(indexes, "embed_texts", _fake_embed)
    text = "One document that two sources both hold."
    chunks = [
        CorpusChunk(chunk_id(text), text, "a", "first", "a"),
        CorpusChunk(chunk_id(text), text, "b", "second", "b"),
        CorpusChunk(chunk_id(GOOD), GOOD, "c", "good", "c"),
    ]
    retriever = langchain_chunks_retriever(chunks, k=5)
    found = retriever.vectorstore.get()  # type: ignore[attr-defined]
    assert sorted(found["ids"]) == sorted([chunk_id(text), chunk_id(GOOD)])
    assert {m["title"] for m in found["metadatas"]} == {"first", "good"}


ODD_FILES = {
    "nfd.txt": "cafe\u0301 written decomposed, as macOS names files: e\u0301\u0301 twice.",
    "nfc.txt": "caf\u00e9 already composed, the form every chunk id is computed on.",
    "rtl.txt": "שלום עולם مرحبا بالعالم \u202ewith an override\u202c and back to LTR.",
    "zwj.txt": "a family 👨\u200d👩\u200d👧 joined by zero\u200bwidth\u200djoiners in a line.",
    "jamo.txt": "\u1100\u1161\u11a8 conjoining jamo that NFC composes into one syllable.",
    "sign.txt": "\u212b the Angstrom sign, which NFC turns into A with a ring.",
    "crlf.txt": "line one\r\nline two\r\n\r\na second paragraph, after a Windows break.",
    "repeat.txt": "the same paragraph twice, word for word.\n\n" * 2,
}
CAPITAL = "The capital of France is Paris, on the river Seine."
# One text starts another, one sits inside both, one is retrieved twice.
NESTED = [CAPITAL + " It has two million people.", CAPITAL, CAPITAL[4:40], CAPITAL]


@pytest.fixture
def tiny_cache() -> ChunkCache:
    lm, tokenizer = tiny_lm("llama"), tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    model = LoadedModel(lm.hf, tokenizer, lm.spec, lm.rope, lm.fingerprint)
    return ChunkCache(backend=LocalBackend(ChunkEngine(model)))


def _odd_folder_chunks(folder: Path) -> list[CorpusChunk]:
    for name, text in ODD_FILES.items():
        (folder / name).write_bytes(text.encode("utf-8"))
    chunks, warned = _load(folder)
    assert not warned and len(chunks) == len(ODD_FILES) + 1
    return chunks


def _nested_chunks(folder: Path) -> list[CorpusChunk]:
    return [CorpusChunk(chunk_id(text), text, "t", "t", "t") for text in NESTED]


@pytest.mark.parametrize("make_chunks", [_odd_folder_chunks, _nested_chunks])
def test_every_indexed_chunk_is_found_again_in_a_prompt(
    make_chunks: Any,
    folder: Path,
    tiny_cache: ChunkCache,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    """Chunks -> Chroma index (real MiniLM) -> ChunkCacheRetriever -> ChunkCacheLLM on a
    tiny model: every chunk the index returns is a chunk hit or miss, never plain text."""
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path / "home"))
    chunks = make_chunks(folder)
    retriever = ChunkCacheRetriever(
        base_retriever=langchain_chunks_retriever(chunks, k=3), cache=tiny_cache
    )
    llm = ChunkCacheLLM(chunk_cache=tiny_cache, max_tokens=1)
    for chunk in chunks:
        documents = retriever.invoke(chunk.text)
        assert chunk.text in [d.page_content for d in documents], chunk.title
        context = "\n\n".join(d.page_content for d in documents)
        prompt = f"Answer from the context.\nContext:\n{context}\nQuestion: w1 w2?"
        stats = llm.invoke([HumanMessage(prompt)]).response_metadata["chunkcache"]
        assert stats["chunk_hits"] + stats["chunk_misses"] == len(documents), prompt


def test_a_chunk_longer_than_the_context_window_is_a_clear_error(
    folder: Path, tiny_cache: ChunkCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(indexes, "embed_texts", _fake_embed)
    (folder / "long.txt").write_text(" ".join(f"w{i % 100}" for i in range(700)), "utf-8")
    chunks = load_text_folder(folder, chunk_chars=10_000)
    retriever = ChunkCacheRetriever(
        base_retriever=langchain_chunks_retriever(chunks, k=2), cache=tiny_cache
    )
    context = "\n\n".join(d.page_content for d in retriever.invoke("w1"))
    llm = ChunkCacheLLM(chunk_cache=tiny_cache, max_tokens=1)
    with pytest.raises(PromptTooLongError, match="exceed the model's context window of 512"):
        llm.invoke([HumanMessage(f"Context:\n{context}\nQuestion?")])

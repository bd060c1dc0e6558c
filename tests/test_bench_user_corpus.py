"""A user's own corpus (folder of text files, Chroma collection) and questions file."""

import hashlib
import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from chromadb import EmbeddingFunction, Embeddings
from chromadb.api.types import Embeddable

from chunkcache.core.chunk_ids import chunk_id, chunk_id_for
from chunkcache.core.corpus import MIN_CHUNK_CHARS
from chunkcache.core.user_corpus import (
    UserCorpusError,
    UserQuestion,
    load_chroma_corpus,
    load_questions,
    load_text_folder,
)

ODD = "Ünïcödé: ﬁne — 日本語テキスト, emoji 🧪, RTL עברית, combining e\u0301."


def _paragraphs(n: int, word: str) -> str:
    return "\n\n".join(f"{word} paragraph {i}: " + "lorem ipsum dolor " * 12 for i in range(n))


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "guides" / "deep").mkdir(parents=True)
    (tmp_path / "guides" / "deep" / "long.md").write_text(_paragraphs(12, "Long"), "utf-8")
    (tmp_path / "guides" / "odd.txt").write_text(ODD, encoding="utf-8")
    (tmp_path / "top.TXT").write_bytes(b"\xef\xbb\xbfTop level note with a BOM.\r\n\r\nSecond.")
    (tmp_path / "empty.md").write_text("  \n\n ", encoding="utf-8")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "secret.txt").write_text("not part of the corpus", "utf-8")
    return tmp_path


def test_folder_round_trip(folder):
    with pytest.warns(UserWarning, match="empty.md"):
        chunks = load_text_folder(folder, chunk_chars=400)
    titles = [chunk.title for chunk in chunks]
    assert sorted(set(titles)) == ["guides/deep/long.md", "guides/odd.txt", "top.TXT"]
    assert titles == sorted(titles)  # sorted path order
    for chunk in chunks:
        assert chunk.chunk_id == chunk_id(chunk.text)
        assert len(chunk.text) <= 400 and chunk.text.startswith(chunk.title + "\n")
        assert chunk.source == chunk.title
    assert {c.topic for c in chunks} == {"guides", "top"}
    odd = next(c for c in chunks if c.title == "guides/odd.txt")
    assert odd.text == "guides/odd.txt\n" + ODD
    top = next(c for c in chunks if c.title == "top.TXT")
    assert top.text.startswith("top.TXT\nTop level note") and "\ufeff" not in top.text
    long = [c.text.split("\n", 1)[1] for c in chunks if c.title.endswith("long.md")]
    assert len(long) > 3
    # Every paragraph lands whole in some chunk, in order.
    joined = "\n\n".join(long)
    assert joined.replace("\n\n", " ").split() == _paragraphs(12, "Long").split()


def test_folder_chunking_matches_the_bundled_default(folder):
    with pytest.warns(UserWarning):
        default = load_text_folder(folder)
    with pytest.warns(UserWarning):
        small = load_text_folder(folder, chunk_chars=MIN_CHUNK_CHARS)
    assert max(len(c.text) for c in default) <= 1000 and len(small) > len(default)
    with pytest.raises(ValueError, match="at least"):
        load_text_folder(folder, chunk_chars=MIN_CHUNK_CHARS - 1)


@pytest.mark.filterwarnings("ignore:skipping empty file")
def test_bad_encoding_is_a_clear_error(folder):
    (folder / "guides" / "latin1.txt").write_bytes("Café crème".encode("latin-1"))
    with pytest.raises(UserCorpusError, match=r"latin1\.txt is not UTF-8 \(byte 3"):
        load_text_folder(folder)


def test_missing_or_empty_folder(tmp_path):
    with pytest.raises(UserCorpusError, match="does not exist"):
        load_text_folder(tmp_path / "nope")
    with pytest.raises(UserCorpusError, match=r"no \.txt or \.md files"):
        load_text_folder(tmp_path)
    (tmp_path / "a.txt").write_text("", encoding="utf-8")
    with pytest.warns(UserWarning), pytest.raises(UserCorpusError, match="only empty"):
        load_text_folder(tmp_path)
    with pytest.raises(UserCorpusError, match="not a directory"):
        load_text_folder(tmp_path / "a.txt")


class TinyEmbedding(EmbeddingFunction[Embeddable]):
    """Eight hashed dimensions: enough for Chroma to store and query, no model."""

    def __init__(self) -> None:
        pass

    def __call__(self, input: Embeddable) -> Embeddings:
        digests = (hashlib.sha256(str(item).encode()).digest()[:8] for item in input)
        return [np.frombuffer(digest, np.uint8).astype(np.float32) for digest in digests]

    @staticmethod
    def name() -> str:
        return "chunkcache-tiny-test"

    def get_config(self) -> dict[str, Any]:
        return {}

    @staticmethod
    def build_from_config(config: dict[str, Any]) -> "TinyEmbedding":
        return TinyEmbedding()


def _collection(path, name="notes", entries=()):
    import chromadb
    from chromadb.config import Settings

    client = chromadb.PersistentClient(path=path, settings=Settings(anonymized_telemetry=False))
    collection = client.create_collection(name, embedding_function=TinyEmbedding())
    ids, docs, metas = zip(*entries, strict=True)
    collection.add(ids=list(ids), documents=list(docs), metadatas=list(metas))
    return collection


def test_chroma_round_trip(tmp_path):
    entries = [
        ("b-2", ODD, {"title": "Odd", "topic": "unicode"}),
        ("a-1", "Velmora Tech was founded in 1923.", {"source": "facts.md"}),
        ("c-3", "Pinned id text.", {"chunk_id": "my-id-1", "title": "Pinned"}),
        ("d-4", "   ", {"title": "blank"}),
    ]
    _collection(tmp_path, entries=entries)
    with pytest.warns(UserWarning, match="skipping 1 entries"):
        chunks = load_chroma_corpus(tmp_path, "notes")
    assert [c.source for c in chunks] == ["a-1", "b-2", "c-3"]
    assert [c.text for c in chunks] == [entries[1][1], ODD, "Pinned id text."]
    pinned = chunk_id_for("Pinned id text.", {"chunk_id": "my-id-1"})
    assert [c.chunk_id for c in chunks] == [chunk_id(entries[1][1]), chunk_id(ODD), pinned]
    assert [c.title for c in chunks] == ["a-1", "Odd", "Pinned"]
    assert [c.topic for c in chunks] == ["facts.md", "unicode", "notes"]
    with pytest.warns(UserWarning):
        again = load_chroma_corpus(str(tmp_path), "notes", embedding_function=TinyEmbedding())
    assert again == chunks


def test_chroma_pages_through_big_collections(tmp_path, monkeypatch):
    from chunkcache.core import user_corpus

    monkeypatch.setattr(user_corpus, "_CHROMA_PAGE", 3)
    entries = [(f"id-{i:02d}", f"document number {i}", {"n": i}) for i in range(10)]
    _collection(tmp_path, entries=entries)
    chunks = load_chroma_corpus(tmp_path, "notes")
    assert [c.text for c in chunks] == [text for _, text, _ in entries]


def test_chroma_errors(tmp_path):
    with pytest.raises(UserCorpusError, match="does not exist"):
        load_chroma_corpus(tmp_path / "nope", "notes")
    _collection(tmp_path, entries=[("x", "some text", {"k": 1})])
    with pytest.raises(UserCorpusError, match=r"no collection 'other' .*it has: notes"):
        load_chroma_corpus(tmp_path, "other")


def test_chroma_a_damaged_database_is_a_clear_error(tmp_path):
    (tmp_path / "chroma.sqlite3").write_bytes(b"not a database")
    with pytest.raises(UserCorpusError, match=r"cannot open the Chroma database .*not a database"):
        load_chroma_corpus(tmp_path, "notes")


def test_chroma_refuses_a_folder_without_a_database_and_leaves_it_alone(tmp_path):
    (tmp_path / "typo").mkdir()
    with pytest.raises(UserCorpusError, match=r"typo has no database \(chroma\.sqlite3\)"):
        load_chroma_corpus(tmp_path / "typo", "notes")
    assert not any((tmp_path / "typo").iterdir())  # Chroma would have made one there


def test_questions_plain_text(tmp_path):
    path = tmp_path / "questions.txt"
    path.write_text("Who founded Velmora Tech?\n\n  Wo liegt Zürich?  \r\n{not json}\n", "utf-8")
    assert load_questions(path) == [
        UserQuestion("Who founded Velmora Tech?"),
        UserQuestion("Wo liegt Zürich?"),
        UserQuestion("{not json}"),
    ]


def test_questions_jsonl_with_optional_answers(tmp_path):
    path = tmp_path / "questions.jsonl"
    rows = [
        {"question": "When was Velmora Tech founded?", "answer": "1923"},
        {"question": "How many staff?", "answer": 4310},
        {"question": "Open question", "answer": None},
        {"question": "No answer field", "extra": [1]},
    ]
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n", "utf-8")
    assert load_questions(path) == [
        UserQuestion("When was Velmora Tech founded?", "1923"),
        UserQuestion("How many staff?", "4310"),
        UserQuestion("Open question"),
        UserQuestion("No answer field"),
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"q\.jsonl:2: not JSON"),
        ('["a list"]', "non-empty string"),
        ('{"question": ""}', "non-empty string"),
        ('{"question": "q", "answer": true}', "string or a number"),
        ('{"question": "q", "answer": ["x"]}', "string or a number"),
    ],
)
def test_questions_jsonl_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "fine"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(UserCorpusError, match=message):
        load_questions(path)


def test_questions_missing_empty_or_undecodable(tmp_path):
    with pytest.raises(UserCorpusError, match="does not exist"):
        load_questions(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("\n \n", encoding="utf-8")
    with pytest.raises(UserCorpusError, match="no questions"):
        load_questions(tmp_path / "empty.txt")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9?\n")
    with pytest.raises(UserCorpusError, match="not UTF-8"):
        load_questions(tmp_path / "bad.txt")


def test_importing_the_module_imports_no_chromadb_or_torch():
    code = (
        "import sys, chunkcache.core.user_corpus\n"
        "loaded = [m for m in ('chromadb', 'torch') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

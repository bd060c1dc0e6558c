"""MiniLM embeddings and the Chroma / FAISS indexes of the bundled corpus.

The indexes are built once under the user cache (about a minute on 2 cores the
first time) and reused by every later run.
"""

import logging
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig
from langchain_tests.integration_tests import (
    EmbeddingsIntegrationTests,
    RetrieversIntegrationTests,
)
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.retrievers import BaseRetriever as LlamaIndexRetriever
from llama_index.core.schema import NodeWithScore, TextNode

from chunkcache.core.chunk_ids import chunk_id
from chunkcache.core.corpus import load_corpus
from chunkcache.integrations import indexes
from chunkcache.integrations.embeddings import (
    EMBEDDING_DIM,
    MiniLMEmbedding,
    MiniLMEmbeddings,
    embed_texts,
)
from chunkcache.integrations.indexes import (
    Store,
    corpus_chroma_collection,
    corpus_faiss_index,
    langchain_corpus_retriever,
    llama_index_corpus_retriever,
    search_corpus,
)

JSON_QUERY = "serialize an object to JSON"
STORES: list[Store] = ["chroma", "faiss"]


@pytest.fixture(scope="module")
def corpus_by_text():
    return {chunk.text: chunk for chunk in load_corpus()}


@pytest.fixture
def embed_calls(monkeypatch) -> list[int]:
    """Replace the model by random unit vectors (the same for the same number of texts);
    the list records how many texts each call embedded."""
    calls: list[int] = []

    def fake_embed(texts: Sequence[str]) -> np.ndarray:
        calls.append(len(texts))
        rng = np.random.default_rng(len(texts))
        vectors = rng.standard_normal((len(texts), EMBEDDING_DIM)).astype(np.float32)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)

    monkeypatch.setattr(indexes, "embed_texts", fake_embed)
    return calls


def test_embed_texts_gives_unit_float32_rows():
    vectors = embed_texts(["parse a date", "open a TCP socket", "parse a date"])
    assert vectors.shape == (3, EMBEDDING_DIM) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(vectors[0], vectors[2], atol=1e-6)
    assert embed_texts([]).shape == (0, EMBEDDING_DIM)


def test_embed_texts_is_thread_safe():
    texts = [f"how do I use module number {i}?" for i in range(8)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        rows = list(pool.map(lambda text: embed_texts([text])[0], texts))
    np.testing.assert_allclose(np.stack(rows), embed_texts(texts), atol=1e-5)


def test_importing_the_modules_imports_no_framework():
    code = (
        "import sys, chunkcache.integrations.indexes\n"
        "loaded = [m for m in ('langchain_core', 'llama_index', 'chromadb', 'faiss', 'torch')"
        " if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_llama_index_embedding_matches_embed_texts():
    model = MiniLMEmbedding()
    assert isinstance(model, BaseEmbedding)
    query = model.get_query_embedding(JSON_QUERY)
    batch = model.get_text_embedding_batch([JSON_QUERY, "x"])
    np.testing.assert_allclose(query, embed_texts([JSON_QUERY])[0], atol=1e-6)
    np.testing.assert_allclose(batch[0], query, atol=1e-6)


async def test_llama_index_embedding_async():
    vector = await MiniLMEmbedding().aget_query_embedding(JSON_QUERY)
    assert len(vector) == EMBEDDING_DIM


class TestMiniLMEmbeddings(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self) -> type[Embeddings]:
        return MiniLMEmbeddings


@pytest.mark.filterwarnings("ignore:legacy embedding function config:DeprecationWarning")
def test_indexes_hold_the_whole_corpus():
    corpus = load_corpus()
    collection = corpus_chroma_collection()
    assert collection.count() == len(corpus)
    hnsw = collection.configuration["hnsw"]
    assert hnsw is not None and hnsw["space"] == "cosine"
    assert collection.get(ids=[corpus[0].chunk_id])["documents"] == [corpus[0].text]
    index = corpus_faiss_index()
    assert index.ntotal == len(corpus) and index.d == EMBEDDING_DIM


@pytest.mark.parametrize("store", STORES)
def test_search_finds_json_and_scores_cosine(store):
    hits = search_corpus(JSON_QUERY, store, k=5)
    assert len(hits) == 5
    assert any(chunk.topic == "json" for chunk, _ in hits)
    scores = [score for _, score in hits]
    assert scores == sorted(scores, reverse=True) and 0 < scores[0] <= 1.0001


def test_chroma_and_faiss_agree():
    def titles(store):
        return [chunk.title for chunk, _ in search_corpus(JSON_QUERY, store, k=3)]

    assert titles("chroma") == titles("faiss")


@pytest.mark.parametrize("store", STORES)
def test_langchain_retriever_returns_corpus_documents(store, corpus_by_text):
    retriever = langchain_corpus_retriever(store, k=5)
    assert isinstance(retriever, BaseRetriever)
    documents = retriever.invoke(JSON_QUERY)
    assert len(documents) == 5
    assert any(doc.metadata["topic"] == "json" for doc in documents)
    for doc in documents:
        chunk = corpus_by_text[doc.page_content]
        assert doc.metadata == {"topic": chunk.topic, "title": chunk.title, "source": chunk.source}
        assert doc.id == chunk_id(doc.page_content)
    assert len(retriever.invoke(JSON_QUERY, k=2)) == 2


@pytest.mark.parametrize("store", STORES)
async def test_langchain_retriever_async(store):
    retriever = langchain_corpus_retriever(store, k=3)
    documents = await retriever.ainvoke(JSON_QUERY)
    assert [doc.page_content for doc in documents] == [
        doc.page_content for doc in retriever.invoke(JSON_QUERY)
    ]
    assert len(await retriever.ainvoke(JSON_QUERY, k=1)) == 1


@pytest.mark.parametrize("store", STORES)
async def test_llama_index_retriever_returns_text_nodes(store, corpus_by_text):
    retriever = llama_index_corpus_retriever(store, similarity_top_k=4)
    assert isinstance(retriever, LlamaIndexRetriever)
    results = retriever.retrieve(JSON_QUERY)
    assert len(results) == 4
    assert any(result.node.metadata["topic"] == "json" for result in results)
    for result in results:
        assert isinstance(result, NodeWithScore) and isinstance(result.node, TextNode)
        chunk = corpus_by_text[result.node.text]
        assert result.node.id_ == chunk.chunk_id
        assert result.node.metadata == {
            "topic": chunk.topic,
            "title": chunk.title,
            "source": chunk.source,
        }
    async_results = await retriever.aretrieve(JSON_QUERY)
    assert [r.node.id_ for r in async_results] == [r.node.id_ for r in results]


class CorpusRetriever(BaseRetriever):
    """``langchain_corpus_retriever(store, k)`` as the ``BaseRetriever`` subclass that
    LangChain's standard tests construct; every call goes to the real retriever."""

    store: Store = "chroma"
    k: int = 5

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        retriever = langchain_corpus_retriever(self.store, k=self.k)
        return retriever.invoke(query, RunnableConfig(callbacks=run_manager.get_child()), **kwargs)

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        retriever = langchain_corpus_retriever(self.store, k=self.k)
        config = RunnableConfig(callbacks=run_manager.get_child())
        return await retriever.ainvoke(query, config, **kwargs)


class TestChromaCorpusRetriever(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[BaseRetriever]:
        return CorpusRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"store": "chroma"}

    @property
    def retriever_query_example(self) -> str:
        return JSON_QUERY


class TestFaissCorpusRetriever(TestChromaCorpusRetriever):
    @property
    def retriever_constructor_params(self) -> dict:
        return {"store": "faiss"}


def test_index_files_are_reused_and_a_corrupt_one_rebuilt(tmp_path, embed_calls):
    chunks = load_corpus(max_chunks=12)
    first = indexes._CorpusIndexes(chunks, tmp_path)
    first.faiss_index()
    assert first.chroma()[1].count() == len(chunks)
    assert embed_calls == [len(chunks)]

    (first.directory / "faiss.index").write_bytes(b"truncated")
    again = indexes._CorpusIndexes(chunks, tmp_path)
    assert again.faiss_index().ntotal == len(chunks)
    assert again.chroma()[1].count() == len(chunks)
    np.testing.assert_array_equal(again.embeddings(), first.embeddings())
    assert embed_calls == [len(chunks)]  # embeddings were read back, not recomputed

    changed = indexes._CorpusIndexes(chunks[:-1], tmp_path)
    assert changed.directory != first.directory
    assert changed.faiss_index().ntotal == len(chunks) - 1
    assert embed_calls == [len(chunks), len(chunks) - 1]


def _hits(corpus_indexes: indexes._CorpusIndexes) -> dict[str, list[tuple[str, float]]]:
    """Per store, the ids and scores of the top hits for the JSON query."""
    return {
        store: [
            (chunk.chunk_id, score) for chunk, score in corpus_indexes.search(JSON_QUERY, store, 5)
        ]
        for store in STORES
    }


def _approx(hits: dict[str, list[tuple[str, float]]]) -> dict[str, list[tuple[str, Any]]]:
    return {
        store: [(cid, pytest.approx(score, abs=1e-5)) for cid, score in h]
        for store, h in hits.items()
    }


def _closed_chroma_dir(corpus_indexes: indexes._CorpusIndexes) -> Path:
    """The Chroma directory, its client closed and its lock released as if the process
    had ended."""
    client = corpus_indexes.chroma()[0]
    client.close()
    corpus_indexes._hold(None)
    return Path(client.get_settings().persist_directory)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.usefixtures("embed_calls")
@pytest.mark.parametrize(
    ("names", "damage"),
    [
        pytest.param(["chroma.sqlite3"], _truncate, id="chroma-sqlite"),
        pytest.param(["data_level0.bin"], _truncate, id="chroma-hnsw"),
        pytest.param(["embeddings.npy"], _empty, id="embeddings"),
        pytest.param(["embeddings.npy", "faiss.index"], _empty, id="embeddings-and-faiss"),
    ],
)
def test_a_damaged_index_file_is_rebuilt(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    names: list[str],
    damage: Callable[[Path], None],
) -> None:
    chunks = load_corpus()  # enough chunks for Chroma to write its HNSW files
    built = indexes._CorpusIndexes(chunks, tmp_path)
    expected = _approx(_hits(built))
    chroma_dir = _closed_chroma_dir(built)
    for name in names:
        damage(next(built.directory.rglob(name)))

    rebuilt = indexes._CorpusIndexes(chunks, tmp_path)
    with caplog.at_level(logging.WARNING, logger=indexes.__name__):
        assert _hits(rebuilt) == expected
    if names[0] in ("chroma.sqlite3", "data_level0.bin"):  # Chroma's files: its directory is named
        named = [f"rebuilding damaged Chroma index {chroma_dir}:"]
        assert not chroma_dir.exists()  # and replaced
    else:
        named = [f"rebuilding damaged {built.directory / name}:" for name in names]
    warnings = [record.getMessage() for record in caplog.records]
    for text in named:
        assert any(text in warning for warning in warnings), warnings

    caplog.clear()
    _closed_chroma_dir(rebuilt)
    reopened = indexes._CorpusIndexes(chunks, tmp_path)
    with caplog.at_level(logging.WARNING, logger=indexes.__name__):
        assert _hits(reopened) == expected
    assert not caplog.records  # the rebuilt files pass the check


@pytest.mark.usefixtures("embed_calls")
def test_a_chroma_rebuild_cut_short_is_never_used(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    chunks = load_corpus(max_chunks=12)
    built = indexes._CorpusIndexes(chunks, tmp_path)
    expected = _approx(_hits(built))
    chroma_dir = _closed_chroma_dir(built)
    _truncate(chroma_dir / "chroma.sqlite3")

    fill = indexes._CorpusIndexes._fill

    def fill_then_die(self: indexes._CorpusIndexes, *args: Any) -> None:
        fill(self, *args)
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(indexes._CorpusIndexes, "_fill", fill_then_die)
    with pytest.raises(RuntimeError, match="mid-build"):
        indexes._CorpusIndexes(chunks, tmp_path).chroma()
    assert not [path for path in built.directory.iterdir() if path.is_dir()]

    monkeypatch.setattr(indexes._CorpusIndexes, "_fill", fill)
    with caplog.at_level(logging.WARNING, logger=indexes.__name__):
        assert _hits(indexes._CorpusIndexes(chunks, tmp_path)) == expected
    assert any(chroma_dir.name in record.getMessage() for record in caplog.records)


def test_unknown_store_is_refused():
    with pytest.raises(ValueError, match="store"):
        search_corpus(JSON_QUERY, "pinecone")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k must be positive"):
        search_corpus(JSON_QUERY, "faiss", k=0)


def test_documents_are_plain_langchain_documents():
    (doc,) = langchain_corpus_retriever("faiss", k=1).invoke("read a CSV file")
    assert type(doc) is Document
    assert "chunk_id" not in doc.metadata

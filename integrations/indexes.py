"""Vector indexes of the bundled stdlib corpus, built once and reused.

Everything lives under ``home_subdir("indexes")/stdlib-<corpus digest>/``: the
MiniLM embeddings (``embeddings.npy`` + ``ids.json``, computed once and shared),
a FAISS ``IndexFlatIP`` (``faiss.index``) and a persistent Chroma collection in
cosine space (``chroma/``).  A changed corpus has a new digest, hence a new
directory; a missing or partial file is rebuilt.

>>> retriever = langchain_corpus_retriever("faiss", k=3)
>>> [doc.metadata["topic"] for doc in retriever.invoke("serialize an object to JSON")][0]
'json'
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from chunkcache.core.corpus import CorpusChunk, corpus_digest, load_corpus
from chunkcache.core.paths import home_subdir
from chunkcache.integrations.embeddings import EMBEDDING_DIM, embed_texts

if TYPE_CHECKING:
    import faiss
    from chromadb import Collection
    from chromadb.api import ClientAPI
    from langchain_core.retrievers import BaseRetriever
    from llama_index.core.retrievers import BaseRetriever as LlamaIndexRetriever

__all__ = [
    "COLLECTION_NAME",
    "corpus_chroma_collection",
    "corpus_faiss_index",
    "langchain_chunks_retriever",
    "langchain_corpus_retriever",
    "llama_index_corpus_retriever",
    "search_corpus",
]

Store = Literal["chroma", "faiss"]
COLLECTION_NAME = "chunkcache-stdlib"
# One lock for all builds: two threads never embed or write the same files at once.
_build_lock = threading.RLock()


def corpus_chroma_collection() -> Collection:
    """The persistent Chroma collection of the corpus (ids are chunk ids, cosine space).

    It has no embedding function: query it with ``query_embeddings=embed_texts([...])``.
    """
    return _corpus_indexes().chroma()[1]


def corpus_faiss_index() -> faiss.Index:
    """The FAISS ``IndexFlatIP`` of the corpus; row ``i`` is ``load_corpus()[i]``."""
    return _corpus_indexes().faiss_index()


def search_corpus(
    query: str, store: Store = "chroma", k: int = 5
) -> list[tuple[CorpusChunk, float]]:
    """The ``k`` corpus chunks nearest to ``query`` and their cosine similarity, best first."""
    return _corpus_indexes().search(query, _checked(store), k)


def langchain_corpus_retriever(store: Store = "chroma", k: int = 5) -> BaseRetriever:
    """A LangChain retriever over the corpus; ``invoke(query, k=...)`` overrides ``k``.

    Documents carry the chunk text, ``topic``/``title``/``source`` metadata and
    the chunk id as ``Document.id``.
    """
    if _checked(store) == "faiss":
        return _langchain_faiss_retriever_class()(k=k)
    return _langchain_chroma_retriever(_corpus_indexes(), k)


def langchain_chunks_retriever(chunks: Sequence[CorpusChunk], k: int = 5) -> BaseRetriever:
    """A LangChain Chroma retriever (MiniLM) over any ``chunks``, e.g. a user's own corpus.

    The index is built once under ``CHUNKCACHE_HOME``, keyed by the chunks' content.
    """
    if not chunks:
        raise ValueError("no chunks to index")
    return _langchain_chroma_retriever(_indexes_of(tuple(chunks)), k)


def _langchain_chroma_retriever(indexes: _CorpusIndexes, k: int) -> BaseRetriever:
    from langchain_chroma import Chroma

    from chunkcache.integrations.embeddings import MiniLMEmbeddings

    client, _ = indexes.chroma()  # built before LangChain opens it
    vectorstore = Chroma(
        client=client,
        collection_name=COLLECTION_NAME,
        embedding_function=MiniLMEmbeddings(),
    )
    return vectorstore.as_retriever(search_kwargs={"k": k})


def llama_index_corpus_retriever(
    store: Store = "chroma", similarity_top_k: int = 5
) -> LlamaIndexRetriever:
    """A LlamaIndex retriever over the corpus: ``TextNode``s whose ``id_`` is the chunk id."""
    return _llama_index_retriever_class()(_checked(store), similarity_top_k)


class _CorpusIndexes:
    """The corpus, its embeddings and both indexes under one directory, built on demand."""

    def __init__(self, chunks: list[CorpusChunk], root: Path) -> None:
        self.chunks = chunks
        self.directory = root / f"stdlib-{corpus_digest(chunks)}"
        self._embeddings: np.ndarray | None = None
        self._faiss: faiss.Index | None = None
        self._chroma: tuple[ClientAPI, Collection] | None = None

    @functools.cached_property
    def chunks_by_id(self) -> dict[str, CorpusChunk]:
        return {chunk.chunk_id: chunk for chunk in self.chunks}

    def embeddings(self) -> np.ndarray:
        """Unit-length embeddings of the chunks, in corpus order: ``[N, 384]`` float32."""
        with _build_lock:
            if self._embeddings is None:
                self._embeddings = self._load_embeddings()
            if self._embeddings is None:
                self._embeddings = embed_texts([chunk.text for chunk in self.chunks])
                self._save_embeddings(self._embeddings)
            return self._embeddings

    def faiss_index(self) -> faiss.Index:
        import faiss

        path = self.directory / "faiss.index"
        with _build_lock:
            if self._faiss is None:
                try:
                    self._faiss = faiss.read_index(str(path))
                except RuntimeError:  # missing or unreadable
                    self._faiss = None
            if self._faiss is None or self._faiss.ntotal != len(self.chunks):
                self._faiss = faiss.IndexFlatIP(EMBEDDING_DIM)
                self._faiss.add(self.embeddings())
                with _replacing(path) as tmp:
                    faiss.write_index(self._faiss, str(tmp))
            return self._faiss

    def chroma(self) -> tuple[ClientAPI, Collection]:
        """The persistent client and the filled collection."""
        import chromadb
        from chromadb.config import Settings

        with _build_lock:
            if self._chroma is None:
                client = chromadb.PersistentClient(
                    path=self.directory / "chroma", settings=Settings(anonymized_telemetry=False)
                )
                collection = client.get_or_create_collection(
                    COLLECTION_NAME,
                    embedding_function=None,
                    configuration={"hnsw": {"space": "cosine"}},
                )
                if collection.count() != len(self.chunks):
                    self._fill(collection, client.get_max_batch_size())
                self._chroma = (client, collection)
            return self._chroma

    def search(self, query: str, store: Store, k: int) -> list[tuple[CorpusChunk, float]]:
        """The ``k`` chunks nearest to ``query`` with their cosine similarity, best first."""
        if k < 1:
            raise ValueError(f"k must be positive, got {k}")
        vector = embed_texts([query])  # [1, 384]
        if store == "faiss":
            scores, rows = self.faiss_index().search(vector, k)  # [1, k] each
            hits = [(int(row), float(score)) for row, score in zip(rows[0], scores[0], strict=True)]
            return [(self.chunks[row], score) for row, score in hits if row >= 0]
        result = self.chroma()[1].query(query_embeddings=vector, n_results=k, include=["distances"])
        distances = (result["distances"] or [[]])[0]
        return [
            (self.chunks_by_id[cid], 1.0 - float(distance))
            for cid, distance in zip(result["ids"][0], distances, strict=True)
        ]

    def _fill(self, collection: Collection, batch_size: int) -> None:
        """Upsert every chunk (idempotent, so a build cut short is simply redone)."""
        vectors = self.embeddings()
        for start in range(0, len(self.chunks), batch_size):
            batch = self.chunks[start : start + batch_size]
            collection.upsert(
                ids=[chunk.chunk_id for chunk in batch],
                embeddings=vectors[start : start + batch_size],
                documents=[chunk.text for chunk in batch],
                metadatas=[_metadata(chunk) for chunk in batch],
            )

    def _load_embeddings(self) -> np.ndarray | None:
        try:
            ids = json.loads((self.directory / "ids.json").read_text(encoding="utf-8"))
            vectors = np.load(self.directory / "embeddings.npy", allow_pickle=False)
        except (OSError, ValueError):
            return None
        expected = [chunk.chunk_id for chunk in self.chunks]
        if ids != expected or vectors.shape != (len(expected), EMBEDDING_DIM):
            return None
        return np.asarray(vectors, dtype=np.float32)

    def _save_embeddings(self, vectors: np.ndarray) -> None:
        with _replacing(self.directory / "embeddings.npy") as tmp, tmp.open("wb") as file:
            np.save(file, vectors, allow_pickle=False)
        ids = [chunk.chunk_id for chunk in self.chunks]
        with _replacing(self.directory / "ids.json") as tmp:
            tmp.write_text(json.dumps(ids), encoding="utf-8")


def _corpus_indexes() -> _CorpusIndexes:
    return _indexes_under(home_subdir("indexes"))


@functools.cache
def _indexes_under(root: Path) -> _CorpusIndexes:
    return _CorpusIndexes(load_corpus(), root)


@functools.cache
def _indexes_of(chunks: tuple[CorpusChunk, ...]) -> _CorpusIndexes:
    return _CorpusIndexes(list(chunks), home_subdir("indexes"))


def _checked(store: Store) -> Store:
    if store not in ("chroma", "faiss"):
        raise ValueError(f"store must be 'chroma' or 'faiss', got {store!r}")
    return store


def _metadata(chunk: CorpusChunk) -> dict[str, str]:
    return {"topic": chunk.topic, "title": chunk.title, "source": chunk.source}


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """A temporary file beside ``path`` that atomically replaces it if the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(handle)
    try:
        yield Path(name)
        os.replace(name, path)
    finally:
        Path(name).unlink(missing_ok=True)


@functools.cache
def _langchain_faiss_retriever_class() -> Callable[..., BaseRetriever]:
    from langchain_core.callbacks import (
        AsyncCallbackManagerForRetrieverRun,
        CallbackManagerForRetrieverRun,
    )
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    class CorpusFaissRetriever(BaseRetriever):
        """The corpus's FAISS index as a LangChain retriever."""

        k: int = 5

        def _get_relevant_documents(
            self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
        ) -> list[Document]:
            hits = search_corpus(query, "faiss", kwargs.get("k", self.k))
            return [
                Document(page_content=chunk.text, metadata=_metadata(chunk), id=chunk.chunk_id)
                for chunk, _ in hits
            ]

        async def _aget_relevant_documents(
            self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
        ) -> list[Document]:
            return await asyncio.to_thread(
                self._get_relevant_documents, query, run_manager=run_manager.get_sync(), **kwargs
            )

    return CorpusFaissRetriever


@functools.cache
def _llama_index_retriever_class() -> Callable[..., LlamaIndexRetriever]:
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

    class CorpusRetriever(BaseRetriever):
        """The corpus's Chroma or FAISS index as a LlamaIndex retriever."""

        def __init__(self, store: Store, similarity_top_k: int) -> None:
            super().__init__()
            self.store: Store = store
            self.similarity_top_k = similarity_top_k

        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            hits = search_corpus(query_bundle.query_str, self.store, self.similarity_top_k)
            return [
                NodeWithScore(
                    node=TextNode(id_=chunk.chunk_id, text=chunk.text, metadata=_metadata(chunk)),
                    score=score,
                )
                for chunk, score in hits
            ]

        async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            return await asyncio.to_thread(self._retrieve, query_bundle)

    return CorpusRetriever

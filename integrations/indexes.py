"""Vector indexes of the bundled stdlib corpus, built once and reused.

Everything lives under ``home_subdir("indexes")/stdlib-<key>/``: the
MiniLM embeddings (``embeddings.npy`` + ``ids.json``, computed once and shared),
a FAISS ``IndexFlatIP`` (``faiss.index``) and a persistent Chroma collection in
cosine space (in the directory that ``chroma.current`` names, ``chroma/`` if there
is no such file).  The key is a hash of everything the directory stores (each chunk's
id, text and metadata, in order, the embedding model and the collection's settings), so
any change to them gets a new directory and an unchanged corpus finds its own.

Every file is checked when it is opened: the embeddings must be the chunks'
unit vectors, and each index must hold exactly those vectors (Chroma must also
find them by query, and its HNSW segment files must agree with their header:
:func:`~.chroma_files.check_hnsw_files`, run before Chroma loads them, since a
damaged ``link_lists.bin`` can crash it).  A missing file is built; a damaged one
is logged as a warning and rebuilt.  Chroma is rebuilt in a fresh directory that
``chroma.current`` is switched to once it passes the same check, so a build cut
short is never used.  A process holds a shared lock on ``<dir>.lock`` while it
builds or uses a Chroma directory; opening the index removes every other
``chroma-*`` directory that no process holds (those of killed builds, and a damaged
one that was still in use when it was replaced).

>>> retriever = langchain_corpus_retriever("faiss", k=3)
>>> [doc.metadata["topic"] for doc in retriever.invoke("serialize an object to JSON")][0]
'json'
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import sqlite3
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, cast

import numpy as np

from chunkcache.core.atomic_files import new_file_mode
from chunkcache.core.corpus import CorpusChunk, load_corpus
from chunkcache.core.paths import home_subdir
from chunkcache.integrations.chroma_files import check_hnsw_files, hold, lock_path, remove_unheld
from chunkcache.integrations.embeddings import EMBEDDING_DIM, embed_texts, model_identity

if TYPE_CHECKING:
    import faiss
    from chromadb import Collection
    from chromadb.api.client import Client
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

logger = logging.getLogger(__name__)

Store = Literal["chroma", "faiss"]
COLLECTION_NAME = "chunkcache-stdlib"
_CHROMA_SPACE: Final = "cosine"
# Part of every directory's key: raise it when what a directory stores, or how, changes.
_INDEX_FORMAT = 1
# Stored vectors equal the embeddings up to float32 rounding (Chroma renormalizes them).
_VECTOR_ATOL = 1e-4
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

    The index is built once under ``CHUNKCACHE_HOME``, keyed by the chunks' ids, texts and
    metadata (a change to any of them builds a new one).
    Chunks with the same id (the same text, e.g. one document stored twice) are indexed
    once, as the first of them.
    """
    if not chunks:
        raise ValueError("no chunks to index")
    unique: dict[str, CorpusChunk] = {}
    for chunk in chunks:
        unique.setdefault(chunk.chunk_id, chunk)  # Chroma refuses an id given twice
    return _langchain_chroma_retriever(_indexes_of(tuple(unique.values())), k)


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
        self.directory = root / f"stdlib-{_index_key(chunks)}"
        self._embeddings: np.ndarray | None = None
        self._faiss: faiss.Index | None = None
        self._chroma: tuple[Client, Collection] | None = None
        self._held: Path | None = None  # the Chroma directory whose lock this holds
        self._release: weakref.finalize[[int], _CorpusIndexes] | None = None  # closes that lock

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
                self._faiss = self._open_faiss(path)
            if self._faiss is None:
                index = faiss.IndexFlatIP(EMBEDDING_DIM)
                index.add(self.embeddings())
                with _replacing(path) as tmp:
                    faiss.write_index(index, str(tmp))
                self._faiss = index
            return self._faiss

    def chroma(self) -> tuple[Client, Collection]:
        """The persistent client and the filled collection."""
        with _build_lock:
            if self._chroma is None:
                vectors = self.embeddings()
                current = self._current_chroma_path()
                self._chroma = None if current is None else self._open_chroma(current, vectors)
                if self._chroma is None:
                    # Damaged: never opened again, and removed unless another process
                    # uses it (it opened it before the damage); then once none does.
                    if current is not None and not remove_unheld(current):
                        logger.info("damaged Chroma index %s is in use; left for now", current)
                    self._chroma = self._build_chroma(vectors)
                self._remove_unused_chroma()
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

    def _open_faiss(self, path: Path) -> faiss.Index | None:
        """The saved index if it holds exactly the embeddings; ``None`` if missing or damaged."""
        import faiss

        if not path.exists():
            return None
        vectors = self.embeddings()
        try:
            index = faiss.read_index(str(path))
            if not isinstance(index, faiss.IndexFlatIP):
                raise ValueError(f"a {type(index).__name__}, not an IndexFlatIP")
            _check_vectors(index.reconstruct_n(0, index.ntotal), vectors)
        except (RuntimeError, ValueError) as error:  # faiss reports a bad file as RuntimeError
            logger.warning("rebuilding damaged %s: %s", path, error)
            return None
        return index

    def _current_chroma_path(self) -> Path | None:
        """The Chroma directory ``chroma.current`` names, ``None`` if there is none.

        Without that file it is ``chroma/``, where earlier versions built the collection.
        """
        pointer = self.directory / "chroma.current"
        try:
            name = pointer.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            legacy = self.directory / "chroma"
            return legacy if legacy.is_dir() else None
        except (OSError, ValueError) as error:
            logger.warning("rebuilding the Chroma index: unreadable %s: %s", pointer, error)
            return None
        path = self.directory / name
        if re.fullmatch(r"chroma-\w+", name) and path.is_dir():
            return path
        logger.warning("rebuilding the Chroma index: %s names no directory: %r", pointer, name)
        return None

    def _open_chroma(self, path: Path, vectors: np.ndarray) -> tuple[Client, Collection] | None:
        """The client and collection at ``path`` if they pass the check; ``None`` if damaged.

        Holds ``path``'s lock from here on, so no other process removes it."""
        from chromadb.errors import ChromaError

        self._hold(path)
        client = None
        try:
            if not path.is_dir():  # removed between reading chroma.current and the lock
                raise ValueError("it is gone")
            check_hnsw_files(path, EMBEDDING_DIM)  # before Chroma loads them
            client = _chroma_client(path)
            collection = client.get_collection(COLLECTION_NAME, embedding_function=None)
            self._check_collection(collection, vectors)
        except (ChromaError, sqlite3.DatabaseError, OSError, ValueError, EOFError) as error:
            logger.warning("rebuilding damaged Chroma index %s: %s", path, error)
            if client is not None:
                client.close()
            self._hold(None)
            return None
        return client, collection

    def _build_chroma(self, vectors: np.ndarray) -> tuple[Client, Collection]:
        """Fill and check a collection in a fresh directory, then point ``chroma.current`` at it.

        The directory's lock is held before the directory exists, so no other process
        ever takes it for a leftover."""
        handle, lock = tempfile.mkstemp(prefix="chroma-", suffix=".lock", dir=self.directory)
        os.close(handle)
        os.chmod(lock, new_file_mode(self.directory))  # other users of the cache lock it too
        path = Path(lock.removesuffix(".lock"))
        self._hold(path)
        client = None
        try:
            path.mkdir()
            client = _chroma_client(path)
            collection = client.create_collection(
                COLLECTION_NAME,
                embedding_function=None,
                configuration={"hnsw": {"space": _CHROMA_SPACE}},
            )
            self._fill(collection, vectors, client.get_max_batch_size())
            self._check_collection(collection, vectors)
            with _replacing(self.directory / "chroma.current") as tmp:
                tmp.write_text(path.name, encoding="ascii")
        except BaseException:
            if client is not None:
                client.close()
            shutil.rmtree(path, ignore_errors=True)
            Path(lock).unlink(missing_ok=True)
            self._hold(None)
            raise
        return client, collection

    def _hold(self, chroma_dir: Path | None) -> None:
        """Hold ``chroma_dir``'s lock (shared) instead of the one held so far; ``None``: none."""
        if self._release is not None:
            self._release()
        fd = None if chroma_dir is None else hold(lock_path(chroma_dir))
        self._release = None if fd is None else weakref.finalize(self, os.close, fd)
        self._held = chroma_dir

    def _remove_unused_chroma(self) -> None:
        """Remove the Chroma directories that neither ``chroma.current`` names nor any
        process holds: those of builds that were killed or lost to a concurrent one, the
        legacy ``chroma/`` once replaced, and lock files whose directory is gone."""
        keep = {self._current_chroma_path(), self._held}
        names = {path.name.removesuffix(".lock") for path in self.directory.glob("chroma-*")}
        candidates = [self.directory / name for name in sorted(names | {"chroma"})]
        for path in candidates:
            unused = path not in keep and (path.is_dir() or lock_path(path).exists())
            if unused and not path.is_symlink() and remove_unheld(path):
                logger.info("removed unused Chroma directory or lock file %s", path)

    def _fill(self, collection: Collection, vectors: np.ndarray, batch_size: int) -> None:
        """Add every chunk with its row of ``vectors``, ``batch_size`` at a time."""
        for start in range(0, len(self.chunks), batch_size):
            batch = self.chunks[start : start + batch_size]
            collection.add(
                ids=[chunk.chunk_id for chunk in batch],
                embeddings=vectors[start : start + batch_size],
                documents=[chunk.text for chunk in batch],
                metadatas=[_metadata(chunk) for chunk in batch],
            )

    def _check_collection(self, collection: Collection, vectors: np.ndarray) -> None:
        """Raise ``ValueError`` unless ``collection`` holds exactly ``vectors`` and finds them."""
        rows = {chunk.chunk_id: row for row, chunk in enumerate(self.chunks)}
        stored = collection.get(include=["embeddings"])
        if sorted(stored["ids"]) != sorted(rows):
            raise ValueError(f"it holds {len(stored['ids'])} ids, not the {len(rows)} chunks'")
        expected = vectors[[rows[cid] for cid in stored["ids"]]]
        _check_vectors(np.asarray(stored["embeddings"]), expected)
        # The first and last vectors must each come back as their own nearest neighbour.
        found = collection.query(
            query_embeddings=expected[[0, -1]], n_results=1, include=["distances"]
        )["distances"]
        if found is None or not np.allclose(found, 0.0, atol=_VECTOR_ATOL):
            raise ValueError(f"a query for a stored vector finds distances {found}")

    def _load_embeddings(self) -> np.ndarray | None:
        """The saved embeddings if they match the chunks; ``None`` if missing or damaged."""
        path = self.directory / "ids.json"
        try:
            if json.loads(path.read_text(encoding="utf-8")) != self._chunk_ids():
                raise ValueError("it does not list the chunk ids")
            path = self.directory / "embeddings.npy"
            vectors = np.load(path, allow_pickle=False)
            if vectors.dtype != np.float32 or vectors.shape != (len(self.chunks), EMBEDDING_DIM):
                raise ValueError(
                    f"{vectors.dtype} {vectors.shape}, not [N, {EMBEDDING_DIM}] float32"
                )
            if not np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=_VECTOR_ATOL):
                raise ValueError("its rows are not unit vectors")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, EOFError) as error:  # np.load raises EOFError on an empty file
            logger.warning("rebuilding damaged %s: %s", path, error)
            return None
        return vectors

    def _save_embeddings(self, vectors: np.ndarray) -> None:
        with _replacing(self.directory / "embeddings.npy") as tmp, tmp.open("wb") as file:
            np.save(file, vectors, allow_pickle=False)
        with _replacing(self.directory / "ids.json") as tmp:
            tmp.write_text(json.dumps(self._chunk_ids()), encoding="utf-8")

    def _chunk_ids(self) -> list[str]:
        return [chunk.chunk_id for chunk in self.chunks]


def _index_key(chunks: Sequence[CorpusChunk]) -> str:
    """A hash of everything an index directory stores: the chunks in order (id, text and
    metadata: a chunk id is bound to its text only), the embedding model and the format."""
    digest = hashlib.blake2b(digest_size=16)
    settings = [_INDEX_FORMAT, model_identity(), COLLECTION_NAME, _CHROMA_SPACE]
    digest.update(json.dumps(settings).encode("ascii"))
    for chunk in chunks:  # one JSON line each: a text's own newlines are escaped
        line = json.dumps([chunk.chunk_id, chunk.text, _metadata(chunk)])
        digest.update(b"\n" + line.encode("ascii"))
    return digest.hexdigest()


def _corpus_indexes() -> _CorpusIndexes:
    return _indexes_under(home_subdir("indexes"))


@functools.cache
def _indexes_under(root: Path) -> _CorpusIndexes:
    return _CorpusIndexes(load_corpus(), root)


@functools.cache
def _indexes_of(chunks: tuple[CorpusChunk, ...]) -> _CorpusIndexes:
    return _CorpusIndexes(list(chunks), home_subdir("indexes"))


def _chroma_client(path: Path) -> Client:
    import chromadb
    from chromadb.config import Settings

    client = chromadb.PersistentClient(path=path, settings=Settings(anonymized_telemetry=False))
    return cast("Client", client)  # typed as the ClientAPI interface, which has no close()


def _check_vectors(found: np.ndarray, expected: np.ndarray) -> None:
    """Raise ``ValueError`` unless an index's vectors are ``expected``, row for row."""
    if found.shape != expected.shape:
        raise ValueError(f"it holds {found.shape} vectors, not {expected.shape}")
    if not np.allclose(found, expected, atol=_VECTOR_ATOL):
        raise ValueError("its vectors differ from the embeddings")


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
        os.chmod(name, new_file_mode(path.parent))  # mkstemp's 0600 would hide it from others
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

"""ChunkCacheRetriever around the retrievers real apps use, over real vector stores (Chroma,
FAISS, LlamaIndex's own) and the offline MiniLM embeddings: the claims a user relies on.

Each returned document names its text by a stable id; that id is what the LLM side finds
in the prompt the app builds from the documents; the access table and the conversation
ledger see each request once, whatever merges, filters or rewrites the documents.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, cast

import chromadb
import faiss
import numpy as np
import pytest
from langchain_chroma import Chroma
from langchain_classic.retrievers import (
    ContextualCompressionRetriever,
    EnsembleRetriever,
    MultiVectorRetriever,
    ParentDocumentRetriever,
    TimeWeightedVectorStoreRetriever,
)
from langchain_classic.retrievers.document_compressors import DocumentCompressorPipeline
from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, Document
from langchain_core.embeddings import Embeddings
from langchain_core.retrievers import BaseRetriever as LangChainRetriever
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda
from langchain_core.stores import InMemoryStore
from langchain_core.vectorstores import VectorStore
from langchain_core.vectorstores.utils import maximal_marginal_relevance
from langchain_text_splitters import CharacterTextSplitter, RecursiveCharacterTextSplitter
from llama_index.core import Document as LlamaDocument
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.llms import MockLLM
from llama_index.core.node_parser import (
    HierarchicalNodeParser,
    SentenceWindowNodeParser,
    get_leaf_nodes,
)
from llama_index.core.postprocessor import MetadataReplacementPostProcessor
from llama_index.core.retrievers import (
    AutoMergingRetriever,
    QueryFusionRetriever,
    RecursiveRetriever,
    VectorIndexRetriever,
)
from llama_index.core.retrievers.fusion_retriever import FUSION_MODES
from llama_index.core.schema import IndexNode, MetadataMode, NodeWithScore, QueryBundle, TextNode
from llama_index.core.storage.docstore import SimpleDocumentStore
from llama_index.core.vector_stores import ExactMatchFilter, MetadataFilters

from chunkcache.core import ChunkCache, chunk_id
from chunkcache.core.corpus import CorpusChunk, load_corpus
from chunkcache.core.segmenter import ChunkSegment, segment_prompt
from chunkcache.integrations import langchain as lc
from chunkcache.integrations import llama_index as li
from chunkcache.integrations.embeddings import EMBEDDING_DIM, embed_texts
from chunkcache.integrations.embeddings import MiniLMEmbedding as _MiniLMEmbedding
from chunkcache.integrations.embeddings import MiniLMEmbeddings as _MiniLMEmbeddings
from chunkcache.integrations.llama_index_llm import node_text

TOPICS = ("json", "re", "csv", "base64", "datetime")
QUESTION = "parse a JSON string into Python objects"


def session(name: str) -> RunnableConfig:
    return RunnableConfig(configurable={"session_id": name})


@pytest.fixture(scope="module")
def chunks() -> list[CorpusChunk]:
    return [chunk for chunk in load_corpus() if chunk.topic in TOPICS][:40]


@pytest.fixture(scope="module")
def embeddings() -> Embeddings:
    return _MiniLMEmbeddings()


# --- the stores -------------------------------------------------------------------------


class FaissStore(VectorStore):
    """A LangChain vector store on a FAISS ``IndexFlatIP`` of unit vectors (cosine), with
    metadata filters and MMR, as langchain-community's FAISS store serves them."""

    def __init__(self, embedding: Embeddings) -> None:
        self.embedding = embedding
        self.index = faiss.IndexFlatIP(EMBEDDING_DIM)
        self.documents: list[Document] = []

    @property
    def embeddings(self) -> Embeddings:
        return self.embedding

    def add_texts(
        self, texts: Any, metadatas: list[dict[str, Any]] | None = None, **kwargs: Any
    ) -> list[str]:
        texts = list(texts)
        vectors = np.asarray(self.embedding.embed_documents(texts), dtype=np.float32)  # [N, D]
        self.index.add(vectors)
        ids = [str(uuid.uuid4()) for _ in texts]
        for i, text in enumerate(texts):
            metadata = dict(metadatas[i]) if metadatas else {}
            self.documents.append(Document(page_content=text, metadata=metadata, id=ids[i]))
        return ids

    @classmethod
    def from_texts(
        cls,
        texts: list[str],
        embedding: Embeddings,
        metadatas: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> FaissStore:
        store = cls(embedding)
        store.add_texts(texts, metadatas)
        return store

    def _select_relevance_score_fn(self) -> Any:
        return lambda score: score  # cosine of unit vectors

    def _ranked(
        self, vector: list[float], filter: dict[str, Any] | None
    ) -> list[tuple[int, float]]:
        query = np.asarray([vector], dtype=np.float32)  # [1, D]
        scores, rows = self.index.search(query, self.index.ntotal)  # [1, N] each
        wanted = (filter or {}).items()
        return [
            (int(row), float(score))
            for row, score in zip(rows[0], scores[0], strict=True)
            if all(self.documents[row].metadata.get(k) == v for k, v in wanted)
        ]

    def similarity_search_with_score(
        self, query: str, k: int = 4, filter: dict[str, Any] | None = None, **kwargs: Any
    ) -> list[tuple[Document, float]]:
        ranked = self._ranked(self.embedding.embed_query(query), filter)[:k]
        return [(self.documents[row], score) for row, score in ranked]

    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return [doc for doc, _ in self.similarity_search_with_score(query, k, **kwargs)]

    def max_marginal_relevance_search(
        self,
        query: str,
        k: int = 4,
        fetch_k: int = 20,
        lambda_mult: float = 0.5,
        filter: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        vector = self.embedding.embed_query(query)
        rows = [row for row, _ in self._ranked(vector, filter)[:fetch_k]]
        vectors = self.index.reconstruct_n(0, self.index.ntotal)  # [N, D]
        candidates = vectors[rows].tolist()  # [fetch_k, D]
        chosen = maximal_marginal_relevance(np.asarray(vector), candidates, lambda_mult, k)
        return [self.documents[rows[i]] for i in chosen]


def chroma_store(embeddings: Embeddings) -> Chroma:
    """An empty in-memory Chroma collection of its own, in cosine space."""
    return Chroma(
        client=chromadb.EphemeralClient(),
        collection_name=f"zoo-{uuid.uuid4().hex[:12]}",
        embedding_function=embeddings,
        collection_configuration={"hnsw": {"space": "cosine"}},
    )


@pytest.fixture(scope="module", params=["chroma", "faiss"])
def store(request: Any, chunks: list[CorpusChunk], embeddings: Embeddings) -> VectorStore:
    filled = chroma_store(embeddings) if request.param == "chroma" else FaissStore(embeddings)
    filled.add_texts(
        [c.text for c in chunks], metadatas=[{"topic": c.topic, "title": c.title} for c in chunks]
    )
    return filled


@pytest.fixture(scope="module")
def chroma(chunks: list[CorpusChunk], embeddings: Embeddings) -> Chroma:
    filled = chroma_store(embeddings)
    filled.add_texts([c.text for c in chunks], metadatas=[{"topic": c.topic} for c in chunks])
    return filled


# --- what a user checks -----------------------------------------------------------------


def prompt_chunk_ids(cache: ChunkCache, texts: Sequence[str]) -> list[str]:
    """The chunk ids the LLM side finds in the prompt an app builds from ``texts``."""
    prompt = "Answer from the context.\n\nContext:\n" + "\n\n".join(texts) + f"\n\n{QUESTION}?"
    return [
        s.chunk_id for s in segment_prompt(prompt, cache.matcher) if isinstance(s, ChunkSegment)
    ]


def check_documents(cache: ChunkCache, documents: Sequence[Document]) -> list[str]:
    """Each document's id names its own text, and is what the prompt of them holds."""
    ids = [doc.metadata["chunk_id"] for doc in documents]
    assert ids == [chunk_id(doc.page_content) for doc in documents]
    assert len(set(ids)) == len(ids)
    assert prompt_chunk_ids(cache, [doc.page_content for doc in documents]) == ids
    return ids


def check_nodes(cache: ChunkCache, nodes: Sequence[NodeWithScore]) -> list[str]:
    """As :func:`check_documents`, for nodes put in a prompt as LlamaIndex renders them."""
    ids = [n.node.metadata["chunk_id"] for n in nodes]
    assert ids == [chunk_id(node_text(n.node)) for n in nodes]
    assert len(set(ids)) == len(ids)
    texts = [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in nodes]
    assert prompt_chunk_ids(cache, texts) == ids
    return ids


# --- LangChain: vectorstore.as_retriever --------------------------------------------------

SEARCHES: dict[str, tuple[str, dict[str, Any]]] = {
    "similarity": ("similarity", {"k": 4}),
    "mmr": ("mmr", {"k": 4, "fetch_k": 12, "lambda_mult": 0.3}),
    "threshold": ("similarity_score_threshold", {"score_threshold": 0.2, "k": 4}),
    "filter": ("similarity", {"k": 3, "filter": {"topic": "re"}}),
}


@pytest.mark.parametrize("search", list(SEARCHES))
def test_every_search_type_gives_stable_ids_the_prompt_holds(
    store: VectorStore, search: str
) -> None:
    search_type, search_kwargs = SEARCHES[search]
    base = store.as_retriever(search_type=search_type, search_kwargs=search_kwargs)
    cache = ChunkCache()
    wrapped = lc.ChunkCacheRetriever(base_retriever=base, cache=cache)
    first = wrapped.invoke(QUESTION, config=session("s"))
    assert first and not any(doc.metadata["seen_in_conversation"] for doc in first)
    ids = check_documents(cache, first)
    assert set(ids) == {chunk_id(doc.page_content) for doc in base.invoke(QUESTION)}
    again = wrapped.invoke(QUESTION, config=session("s"))
    assert [doc.metadata["chunk_id"] for doc in again] == ids
    assert all(doc.metadata["seen_in_conversation"] for doc in again)
    if search == "filter":
        assert {doc.metadata["topic"] for doc in first} == {"re"}
    # k= cuts at the base: the base's own top 2, whatever order the cache gives them.
    two = wrapped.invoke(QUESTION, config=session("s"), k=2)
    assert {d.metadata["chunk_id"] for d in two} == {
        chunk_id(d.page_content) for d in base.invoke(QUESTION, k=2)
    }


@pytest.mark.parametrize("is_async", [False, True])
async def test_a_threshold_no_document_passes_returns_nothing_and_records_nothing(
    store: VectorStore, is_async: bool
) -> None:
    base = store.as_retriever(
        search_type="similarity_score_threshold", search_kwargs={"score_threshold": 0.99}
    )
    cache = ChunkCache()
    wrapped = lc.ChunkCacheRetriever(base_retriever=base, cache=cache, dedupe="drop", k=3)
    if is_async:
        docs = await wrapped.ainvoke(QUESTION, config=session("s"))
    else:
        docs = wrapped.invoke(QUESTION, config=session("s"))
    assert docs == []
    assert not cache.ledger.seen("s") and len(cache.registry) == 0


def test_frequency_order_puts_the_chunks_more_requests_retrieved_first(
    store: VectorStore,
) -> None:
    cache = ChunkCache()
    wrapped = lc.ChunkCacheRetriever(
        base_retriever=store.as_retriever(search_kwargs={"k": 4}),
        cache=cache,
        ordering="frequency",
    )
    for question in ("serialize an object to JSON", "decode JSON", QUESTION, "regular expression"):
        wrapped.invoke(question)
    docs = wrapped.invoke("JSON encoder and decoder")
    counts = [cache.access_table.count(doc.metadata["chunk_id"]) for doc in docs]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]
    # The same set comes back in the same order: what lines the prompt prefixes up.
    again = wrapped.invoke("JSON encoder and decoder")
    assert [d.metadata["chunk_id"] for d in again] == [d.metadata["chunk_id"] for d in docs]


# --- LangChain: langchain-classic's retrievers -------------------------------------------


def ensemble_of(store: VectorStore, wrap: ChunkCache | None = None) -> EnsembleRetriever:
    """Similarity and MMR over one store, each wrapped on ``wrap`` when given."""
    subs: list[LangChainRetriever] = [
        store.as_retriever(search_kwargs={"k": 4}),
        store.as_retriever(search_type="mmr", search_kwargs={"k": 4, "lambda_mult": 0.3}),
    ]
    if wrap is not None:
        subs = [lc.ChunkCacheRetriever(base_retriever=s, cache=wrap) for s in subs]
    return EnsembleRetriever(
        retrievers=list[Runnable[str, list[Document]]](subs), weights=[0.5, 0.5]
    )


@pytest.mark.parametrize("is_async", [False, True])
async def test_a_wrapped_ensemble_is_one_request_also_over_wrapped_retrievers(
    store: VectorStore, is_async: bool
) -> None:
    plain = ensemble_of(store).invoke(QUESTION)
    assert len(plain) > 4  # the two searches returned some chunks once, some twice
    for inner in (False, True):
        cache = ChunkCache()
        ensemble = ensemble_of(store, wrap=cache if inner else None)
        wrapped = lc.ChunkCacheRetriever(base_retriever=ensemble, cache=cache, ordering="retriever")
        if is_async:
            docs = await wrapped.ainvoke(QUESTION, config=session("s"))
        else:
            docs = wrapped.invoke(QUESTION, config=session("s"))
        # The fusion saw the sub-retrievers' own documents: the same ranking as unwrapped.
        assert [d.page_content for d in docs] == [d.page_content for d in plain]
        ids = check_documents(cache, docs)
        assert cache.num_requests == 1
        assert all(cache.access_table.count(cid) == 1 for cid in ids)
        assert cache.ledger.seen("s") == set(ids)


def test_an_ensemble_of_wrapped_retrievers_keeps_the_chunks_new_to_the_conversation(
    store: VectorStore,
) -> None:
    """Without a wrapper around the ensemble each wrapped retriever plans its own request:
    the second sees the first's chunks as already in the conversation, but the ensemble
    keeps the first retriever's copy of a document both returned."""
    cache = ChunkCache()
    ensemble = ensemble_of(store, wrap=cache)
    first = ensemble.invoke(QUESTION, config=session("s"))
    assert not any(doc.metadata["seen_in_conversation"] for doc in first)
    assert {d.metadata["chunk_id"] for d in first} == cache.ledger.seen("s")
    assert cache.num_requests == 2  # one per wrapper
    check_documents(cache, first)
    again = ensemble.invoke(QUESTION, config=session("s"))
    assert all(doc.metadata["seen_in_conversation"] for doc in again)
    # With "drop" the second wrapper leaves out what the first one just returned: the
    # ensemble still has one copy of each chunk.
    cache = ChunkCache()
    dropping = EnsembleRetriever(
        retrievers=[
            lc.ChunkCacheRetriever(base_retriever=r.base_retriever, cache=cache, dedupe="drop")
            for r in ensemble.retrievers
            if isinstance(r, lc.ChunkCacheRetriever)
        ],
        weights=[0.5, 0.5],
    )
    docs = dropping.invoke(QUESTION, config=session("d"))
    assert {d.page_content for d in docs} == {d.page_content for d in first}
    check_documents(cache, docs)


class SimilarityFilter(BaseDocumentCompressor):
    """Keeps the documents whose MiniLM cosine to the query passes ``threshold`` (what
    langchain-community's EmbeddingsFilter does)."""

    threshold: float = 0.3

    def compress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        if not documents:
            return []
        vectors = embed_texts([doc.page_content for doc in documents])  # [N, D]
        scores = vectors @ embed_texts([query])[0]  # [N]
        return [doc for doc, score in zip(documents, scores, strict=True) if score > self.threshold]


def splitting_pipeline() -> DocumentCompressorPipeline:
    """Splits each document in pieces of at most 300 characters, keeps the relevant ones."""
    splitter = CharacterTextSplitter(chunk_size=300, chunk_overlap=0, separator="\n")
    return DocumentCompressorPipeline(transformers=[splitter, SimilarityFilter()])


@pytest.mark.parametrize("inner", [False, True])
def test_a_wrapper_around_a_splitting_compressor_names_the_pieces_the_prompt_gets(
    store: VectorStore, inner: bool
) -> None:
    cache = ChunkCache()
    base: LangChainRetriever = store.as_retriever(search_kwargs={"k": 3})
    if inner:  # the app wrapped the vector retriever already: the outer one plans
        base = lc.ChunkCacheRetriever(base_retriever=base, cache=cache)
    compressing = ContextualCompressionRetriever(
        base_compressor=splitting_pipeline(), base_retriever=base
    )
    wrapped = lc.ChunkCacheRetriever(base_retriever=compressing, cache=cache)
    docs = wrapped.invoke(QUESTION, config=session("s"))
    assert docs and all(len(doc.page_content) <= 300 for doc in docs)
    ids = check_documents(cache, docs)
    assert cache.ledger.seen("s") == set(ids) and cache.num_requests == 1
    assert [d.metadata["chunk_id"] for d in wrapped.invoke(QUESTION)] == ids


def test_a_wrapper_inside_a_splitting_compressor_gives_ids_of_texts_not_in_the_prompt(
    store: VectorStore,
) -> None:
    """The documented leftover: a compressor that rewrites texts after the wrapper gave
    them ids keeps those ids in the pieces' metadata; the prompt holds no such chunk."""
    cache = ChunkCache()
    compressing = ContextualCompressionRetriever(
        base_compressor=splitting_pipeline(),
        base_retriever=lc.ChunkCacheRetriever(
            base_retriever=store.as_retriever(search_kwargs={"k": 3}), cache=cache
        ),
    )
    pieces = compressing.invoke(QUESTION, config=session("s"))
    assert pieces
    assert all(doc.metadata["chunk_id"] != chunk_id(doc.page_content) for doc in pieces)
    assert prompt_chunk_ids(cache, [doc.page_content for doc in pieces]) == []


class KeepAll(BaseDocumentCompressor):
    """A compressor that keeps every document (a reranker's place)."""

    def compress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        return list(documents)


def test_a_wrapper_inside_a_compressor_has_the_conversation_of_a_chain_or_a_keyword(
    chroma: Chroma,
) -> None:
    """ContextualCompressionRetriever calls its base without the caller's config: invoked
    directly, the wrapper inside it sees no conversation; in a chain it reads the chain's
    config, and a ``conversation_id`` keyword reaches it."""
    cache = ChunkCache()
    compressing = ContextualCompressionRetriever(
        base_compressor=KeepAll(),
        base_retriever=lc.ChunkCacheRetriever(
            base_retriever=chroma.as_retriever(search_kwargs={"k": 3}), cache=cache
        ),
    )
    compressing.invoke(QUESTION, config=session("direct"))
    assert "direct" not in cache.ledger
    chain = RunnableLambda(lambda question: question) | compressing
    sent = chain.invoke(QUESTION, config=session("chain"))
    assert cache.ledger.seen("chain") == {doc.metadata["chunk_id"] for doc in sent}
    again = compressing.invoke(QUESTION, conversation_id="chain")
    assert all(doc.metadata["seen_in_conversation"] for doc in again)


@pytest.fixture(scope="module")
def parent_retriever(chunks: list[CorpusChunk], embeddings: Embeddings) -> ParentDocumentRetriever:
    """Children of 2,000 characters in Chroma; parents of ~50,000 characters in a docstore."""
    parents = [
        Document(
            page_content="\n\n".join(c.text for c in chunks[i : i + 10] * 7), metadata={"n": i}
        )
        for i in range(0, len(chunks), 10)
    ]
    retriever = ParentDocumentRetriever(
        vectorstore=chroma_store(embeddings),
        docstore=InMemoryStore(),
        child_splitter=RecursiveCharacterTextSplitter(chunk_size=2000, chunk_overlap=0),
        search_kwargs={"k": 8},
    )
    retriever.add_documents(parents)
    return retriever


def test_huge_parent_documents_get_ids_the_prompt_holds(
    parent_retriever: ParentDocumentRetriever,
) -> None:
    cache = ChunkCache()
    wrapped = lc.ChunkCacheRetriever(base_retriever=parent_retriever, cache=cache)
    docs = wrapped.invoke(QUESTION, config=session("s"))
    assert docs and all(len(doc.page_content) > 40_000 for doc in docs)
    ids = check_documents(cache, docs)
    (one,) = wrapped.invoke(QUESTION, config=session("s"), k=1)
    assert one.metadata["chunk_id"] in ids and one.metadata["seen_in_conversation"]
    assert all(cache.registry.get(cid) is not None for cid in ids)


def test_a_multi_vector_retriever_gives_the_ids_of_the_full_documents(
    chunks: list[CorpusChunk], embeddings: Embeddings
) -> None:
    """Titles are searched, full chunks returned: the ids name the full chunks."""
    vectorstore, docstore = chroma_store(embeddings), InMemoryStore()
    keys = [str(uuid.uuid4()) for _ in chunks]
    vectorstore.add_texts([c.title for c in chunks], metadatas=[{"doc_id": k} for k in keys])
    docstore.mset([(k, Document(page_content=c.text)) for k, c in zip(keys, chunks, strict=True)])
    cache = ChunkCache()
    wrapped = lc.ChunkCacheRetriever(
        base_retriever=MultiVectorRetriever(vectorstore=vectorstore, docstore=docstore),
        cache=cache,
    )
    docs = wrapped.invoke("json.loads")
    texts = {c.text for c in chunks}
    assert docs and all(doc.page_content in texts for doc in docs)
    check_documents(cache, docs)


# LangChain warns that Chroma's relevance scores (1 - cosine distance) leave [0, 1].
@pytest.mark.filterwarnings("ignore:Relevance scores must be between")
def test_a_time_weighted_retriever_mutating_its_documents_keeps_their_ids(
    chunks: list[CorpusChunk], embeddings: Embeddings
) -> None:
    now = time.time()
    retriever = TimeWeightedVectorStoreRetriever(
        vectorstore=chroma_store(embeddings), decay_rate=0.01, k=3
    )
    retriever.add_documents(
        [
            Document(page_content=c.text, metadata={"last_accessed_at": now, "created_at": now})
            for c in chunks[:20]
        ]
    )
    cache = ChunkCache()
    wrapped = lc.ChunkCacheRetriever(base_retriever=retriever, cache=cache)
    first = wrapped.invoke(QUESTION, config=session("s"))
    second = wrapped.invoke(QUESTION, config=session("s"))
    ids = check_documents(cache, first)
    assert {d.metadata["chunk_id"] for d in second} == set(ids)
    # The wrapper's metadata went to copies: the retriever's memory is as it keeps it.
    assert not any("chunk_id" in doc.metadata for doc in retriever.memory_stream)
    assert all(doc.metadata["last_accessed_at"] for doc in second)


# --- LlamaIndex ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embed_model() -> Any:
    return _MiniLMEmbedding()


@pytest.fixture(scope="module")
def index(chunks: list[CorpusChunk], embed_model: Any) -> VectorStoreIndex:
    nodes = [TextNode(text=c.text, metadata={"topic": c.topic}) for c in chunks]
    return VectorStoreIndex(nodes, embed_model=embed_model)


def topic_filter(topic: str) -> MetadataFilters:
    return MetadataFilters(filters=[ExactMatchFilter(key="topic", value=topic)])


@pytest.mark.parametrize("topic", [None, "re", "no such topic"])
def test_an_index_retriever_gives_stable_ids_the_prompt_holds(
    index: VectorStoreIndex, topic: str | None
) -> None:
    filters = None if topic is None else topic_filter(topic)
    base = index.as_retriever(similarity_top_k=4, filters=filters)
    cache = ChunkCache()
    wrapped = li.ChunkCacheRetriever(base, cache=cache).for_conversation("s")
    first = wrapped.retrieve(QUESTION)
    if topic == "no such topic":
        assert first == [] and not cache.ledger.seen("s")
        return
    ids = check_nodes(cache, first)
    assert set(ids) == {chunk_id(node_text(n.node)) for n in base.retrieve(QUESTION)}
    assert topic is None or {n.node.metadata["topic"] for n in first} == {topic}
    again = wrapped.retrieve(QUESTION)
    assert [n.node.metadata["chunk_id"] for n in again] == ids
    assert all(n.node.metadata["seen_in_conversation"] for n in again)


def test_both_wrappers_give_one_text_one_id(index: VectorStoreIndex, store: VectorStore) -> None:
    cache = ChunkCache()
    nodes = li.ChunkCacheRetriever(index.as_retriever(similarity_top_k=4), cache=cache).retrieve(
        QUESTION
    )
    docs = lc.ChunkCacheRetriever(
        base_retriever=store.as_retriever(search_kwargs={"k": 4}), cache=cache
    ).invoke(QUESTION)
    by_text = {n.node.get_content(): n.node.metadata["chunk_id"] for n in nodes}
    shared = [doc for doc in docs if doc.page_content in by_text]
    assert shared  # the same MiniLM vectors find the same chunks
    assert all(by_text[doc.page_content] == doc.metadata["chunk_id"] for doc in shared)


def parent_nodes(chunks: list[CorpusChunk]) -> list[TextNode]:
    return [
        TextNode(text="\n\n".join(c.text for c in chunks[i : i + 8]), id_=f"parent-{i}")
        for i in range(0, len(chunks), 8)
    ]


def test_a_recursive_retriever_gives_its_parents_ids_the_prompt_holds(
    chunks: list[CorpusChunk], embed_model: Any
) -> None:
    parents = parent_nodes(chunks)
    children = [
        IndexNode(text=part, index_id=parent.id_)
        for parent in parents
        for part in parent.text.split("\n\n")[:4]
    ]
    vector = VectorStoreIndex(children, embed_model=embed_model).as_retriever(similarity_top_k=3)
    node_dict: dict[str, Any] = {parent.id_: parent for parent in parents}
    retriever = RecursiveRetriever("vector", retriever_dict={"vector": vector}, node_dict=node_dict)
    cache = ChunkCache()
    nodes = li.ChunkCacheRetriever(retriever, cache=cache).retrieve(QUESTION)
    assert nodes and {n.node.node_id for n in nodes} <= {p.id_ for p in parents}
    check_nodes(cache, nodes)
    # Wrapped inside, the wrapper names the children; the parents come back without ids.
    inner = li.ChunkCacheRetriever(vector, cache=ChunkCache())
    retriever = RecursiveRetriever("vector", retriever_dict={"vector": inner}, node_dict=node_dict)
    assert not any("chunk_id" in n.node.metadata for n in retriever.retrieve(QUESTION))


def test_an_auto_merging_retriever_gives_merged_parents_ids_the_prompt_holds(
    chunks: list[CorpusChunk], embed_model: Any
) -> None:
    json_chunks = [c for c in chunks if c.topic == "json"][:5]
    document = LlamaDocument(text="\n\n".join(c.text for c in json_chunks))
    parser = HierarchicalNodeParser.from_defaults(chunk_sizes=[512, 128, 64])
    hierarchy = parser.get_nodes_from_documents([document])
    leaves = get_leaf_nodes(hierarchy)
    docstore = SimpleDocumentStore()
    docstore.add_documents(hierarchy)
    storage = StorageContext.from_defaults(docstore=docstore)
    leaf_index = VectorStoreIndex(leaves, storage_context=storage, embed_model=embed_model)
    retriever = AutoMergingRetriever(
        VectorIndexRetriever(leaf_index, similarity_top_k=30), storage, simple_ratio_thresh=0.3
    )
    cache = ChunkCache()
    nodes = li.ChunkCacheRetriever(retriever, cache=cache).retrieve(QUESTION)
    leaf_ids = {leaf.node_id for leaf in leaves}
    assert any(n.node.node_id not in leaf_ids for n in nodes)  # some merged into a parent
    check_nodes(cache, nodes)
    assert not any("chunk_id" in docstore.get_node(leaf.node_id).metadata for leaf in leaves)
    # Wrapped inside, the wrapper names the leaves; the merged parents come back without ids.
    wrapped_leaves = li.ChunkCacheRetriever(leaf_index.as_retriever(similarity_top_k=30))
    inner = AutoMergingRetriever(
        cast(VectorIndexRetriever, wrapped_leaves),  # it only calls retrieve() on it
        storage,
        simple_ratio_thresh=0.3,
    )
    merged = [n for n in inner.retrieve(QUESTION) if n.node.node_id not in leaf_ids]
    assert merged and not any("chunk_id" in n.node.metadata for n in merged)


def fusion_subs(index: VectorStoreIndex, other: VectorStoreIndex | None = None) -> list[Any]:
    """Similarity and MMR (over ``other`` when given): they rank some chunks alike."""
    mmr = (other or index).as_retriever(
        similarity_top_k=4,
        vector_store_query_mode="mmr",
        vector_store_kwargs={"mmr_threshold": 0.3},
    )
    return [index.as_retriever(similarity_top_k=4), mmr]


def fusion(subs: list[Any]) -> QueryFusionRetriever:
    return QueryFusionRetriever(
        subs, llm=MockLLM(), mode=FUSION_MODES.RECIPROCAL_RANK, num_queries=1, similarity_top_k=6
    )


def test_a_wrapped_fusion_retriever_fuses_as_unwrapped_also_over_wrapped_retrievers(
    index: VectorStoreIndex,
) -> None:
    plain = fusion(fusion_subs(index)).retrieve(QUESTION)
    assert len(plain) == 6 and plain[0].score == pytest.approx(2 / 60)  # both ranked it first
    for inner in (False, True):
        cache = ChunkCache()
        subs = fusion_subs(index)
        if inner:
            subs = [li.ChunkCacheRetriever(s, cache=cache) for s in subs]
        wrapped = li.ChunkCacheRetriever(fusion(subs), cache=cache, ordering="retriever")
        nodes = wrapped.for_conversation("s").retrieve(QUESTION)
        assert [(n.node.node_id, n.score) for n in nodes] == [
            (n.node.node_id, n.score) for n in plain
        ]
        ids = check_nodes(cache, nodes)
        assert cache.num_requests == 1 and cache.ledger.seen("s") == set(ids)


def test_a_fusion_of_wrapped_retrievers_alone_is_the_documented_leftover(
    index: VectorStoreIndex, chunks: list[CorpusChunk], embed_model: Any
) -> None:
    """Each wrapped retriever gives a chunk its own metadata, so the fusion scores its
    copies apart: a chunk both retrievers found is not ranked up, and its copies take two
    of the fusion's ``similarity_top_k`` places.  LlamaIndex then returns it once when
    the copies are one node; from two indexes of one corpus (two node ids) it comes out
    twice, and a ChunkCachePostprocessor sends it once."""
    plain = fusion(fusion_subs(index)).retrieve(QUESTION)
    cache = ChunkCache()
    subs = [li.ChunkCacheRetriever(s, cache=cache, conversation_id="s") for s in fusion_subs(index)]
    nodes = fusion(subs).retrieve(QUESTION)
    assert 0 < len(nodes) < len(plain) and nodes[0].score == pytest.approx(1 / 60)
    check_nodes(cache, nodes)

    other = VectorStoreIndex(
        [TextNode(text=c.text, metadata={"topic": c.topic}) for c in chunks],
        embed_model=embed_model,
    )
    cache = ChunkCache()
    subs = [
        li.ChunkCacheRetriever(s, cache=cache, conversation_id="s")
        for s in fusion_subs(index, other)
    ]
    nodes = fusion(subs).retrieve(QUESTION)
    ids = [n.node.metadata["chunk_id"] for n in nodes]
    assert len(set(ids)) < len(ids)
    once = li.ChunkCachePostprocessor(cache=cache, conversation_id="s").postprocess_nodes(
        nodes, QueryBundle(QUESTION)
    )
    assert check_nodes(cache, once) == list(dict.fromkeys(ids))


def test_sentence_windows_replaced_before_the_postprocessor_are_the_chunks(
    chunks: list[CorpusChunk], embed_model: Any
) -> None:
    documents = [
        LlamaDocument(text=c.text.replace("\n", " "), metadata={"topic": c.topic})
        for c in chunks
        if c.topic == "json"
    ][:4]
    nodes = SentenceWindowNodeParser.from_defaults(window_size=2).get_nodes_from_documents(
        documents
    )
    window_index = VectorStoreIndex(nodes, embed_model=embed_model)
    cache = ChunkCache()
    engine = window_index.as_query_engine(
        llm=MockLLM(),
        similarity_top_k=3,
        response_mode="compact",
        node_postprocessors=[
            MetadataReplacementPostProcessor(target_metadata_key="window"),
            li.ChunkCachePostprocessor(cache=cache, conversation_id="s"),
        ],
    )
    first = engine.query(QUESTION).source_nodes
    ids = check_nodes(cache, first)
    windows = {n.metadata["window"] for n in nodes}
    assert all(node_text(n.node) in windows for n in first)
    assert not any(n.node.metadata["seen_in_conversation"] for n in first)
    again = engine.query(QUESTION).source_nodes
    assert [n.node.metadata["chunk_id"] for n in again] == ids
    assert all(n.node.metadata["seen_in_conversation"] for n in again)


def test_a_wrapped_retriever_under_a_window_replacement_names_the_windows_after_it(
    chunks: list[CorpusChunk], embed_model: Any
) -> None:
    documents = [LlamaDocument(text=c.text.replace("\n", " ")) for c in chunks if c.topic == "re"][
        :4
    ]
    nodes = SentenceWindowNodeParser.from_defaults(window_size=2).get_nodes_from_documents(
        documents
    )
    cache = ChunkCache()
    retriever = li.ChunkCacheRetriever(
        VectorStoreIndex(nodes, embed_model=embed_model).as_retriever(similarity_top_k=3),
        cache=cache,
        conversation_id="s",
    )
    sentences = retriever.retrieve("match a pattern at the start of a string")
    replaced = MetadataReplacementPostProcessor(target_metadata_key="window").postprocess_nodes(
        sentences
    )
    windows = li.ChunkCachePostprocessor(cache=cache, conversation_id="s").postprocess_nodes(
        replaced
    )
    check_nodes(cache, windows)

"""LlamaIndex recipes as users write them (session 27): ``index.as_chat_engine`` in its
retrieval modes, ``as_query_engine`` in each response mode (streaming and async too),
``CitationQueryEngine`` and node postprocessors that change a node's text.

Retrieval runs on a real ``VectorStoreIndex``; its embedding is LlamaIndex's
``MockEmbedding`` (every text the same vector, so the index returns its first nodes for
any question and a chat's context stays put from turn to turn).  Generation runs on the
fake backend, or where the engine's memory of a conversation matters, on a tiny random
model under SmolLM2's tokenizer and chat template.  Each LLM call's chunkcache stats are
read as a LlamaIndex app reads them: from the instrumentation dispatcher's LLM end events.
"""

from __future__ import annotations

import asyncio
import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from fake_backend import FakeBackend
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.bridge.pydantic import Field
from llama_index.core.chat_engine.types import BaseChatEngine, ChatMode
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.postprocessor import MetadataReplacementPostProcessor
from llama_index.core.query_engine import CitationQueryEngine, RetrieverQueryEngine
from llama_index.core.response_synthesizers import ResponseMode
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from test_llama_index_llm import backend_of, chunk_ids, make_llm
from tiny_models import tiny_hf_model

from chunkcache.core import ChunkCache, chunk_id
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.model_files import pull_default_model
from chunkcache.core.models import LoadedModel
from chunkcache.integrations.llama_index import (
    ChunkCacheLLM,
    ChunkCachePostprocessor,
    ChunkCacheRetriever,
)

FACTS = [
    f"Fact {i}: the {name} module {what}, and its documentation lists every option."
    for i, (name, what) in enumerate(
        [
            ("json", "serializes Python objects to JSON text and parses JSON back"),
            ("pathlib", "joins path segments with the slash operator"),
            ("itertools", "chains several iterables one after another"),
            ("functools", "memoizes the results of a function call"),
            ("datetime", "parses a date string according to a format"),
        ]
    )
]
QUESTIONS = ("How do I write JSON?", "And how do I read it back?", "Which options are there?")


class LLMStats(BaseEventHandler):
    """Each LLM call's ``additional_kwargs["chunkcache"]``, from the dispatcher's events."""

    calls: list[dict[str, Any]] = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "LLMStats"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent | LLMCompletionEndEvent) and event.response:
            self.calls.append(event.response.additional_kwargs["chunkcache"])


@pytest.fixture
def llm_stats() -> Iterator[list[dict[str, Any]]]:
    """The stats of every LLM call made while the test runs."""
    handler = LLMStats()
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    yield handler.calls
    dispatcher.event_handlers.remove(handler)


@pytest.fixture(scope="module")
def tiny_chat_lm() -> LoadedModel:
    """A tiny random model with SmolLM2's tokenizer and chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pull_default_model())
    hf = tiny_hf_model(vocab_size=len(tokenizer), max_position_embeddings=4096)
    return LoadedModel.from_hf(hf, tokenizer)


def facts_index(texts: list[str] = FACTS) -> VectorStoreIndex:
    """A vector index of ``texts``, one node each, that returns its first nodes for any query."""
    return VectorStoreIndex.from_documents(
        [Document(text=text) for text in texts],
        embed_model=MockEmbedding(embed_dim=8),
        transformations=[SentenceSplitter(chunk_size=1024)],
    )


def chat_engine(
    index: VectorStoreIndex, llm: ChunkCacheLLM, mode: str, conversation_id: str = "user-42"
) -> BaseChatEngine:
    """``index.as_chat_engine`` as the module docs show: the LLM bound to the conversation,
    the postprocessor planning each turn's nodes for it."""
    planner = ChunkCachePostprocessor(cache=llm.cache, conversation_id=conversation_id)
    return index.as_chat_engine(
        chat_mode=ChatMode(mode),
        llm=llm.for_conversation(conversation_id),
        node_postprocessors=[planner],
        similarity_top_k=2,
    )


# --- recipe 1: as_chat_engine ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["context", "condense_plus_context"])
def test_each_chat_turn_reuses_the_whole_turn_before(
    tiny_chat_lm: LoadedModel, llm_stats: list[dict[str, Any]], mode: str
) -> None:
    """While the context stays put, a turn extends the one before, answer included.
    ``condense_plus_context`` rewrites the question with a completion of the same
    conversation between two turns: when the engine kept one sequence per conversation,
    that completion displaced the turn, and the next took from the store only the prompt
    up to the end of the context."""
    cache = ChunkCache(backend=LocalBackend(ChunkEngine(tiny_chat_lm)))
    engine = chat_engine(facts_index(), ChunkCacheLLM(cache=cache, max_tokens=4), mode)
    for question in QUESTIONS:
        engine.chat(question)
    answered = [call for call in llm_stats if call["chunk_hits"] + call["chunk_misses"]]
    assert len(answered) == 3 and len(llm_stats) == (3 if mode == "context" else 5)
    for before, turn in itertools.pairwise(answered):
        assert turn["chunk_hits"] == 2
        assert turn["reused_tokens"] >= before["prompt_tokens"]


@pytest.mark.parametrize("mode", ["context", "condense_plus_context", "condense_question"])
def test_chat_modes_find_the_chunks_and_mark_them_seen_per_conversation(mode: str) -> None:
    llm = make_llm()
    index = facts_index()
    engine = chat_engine(index, llm, mode)
    turns = [engine.chat(q).source_nodes for q in QUESTIONS]
    seen = [[n.node.metadata["seen_in_conversation"] for n in nodes] for nodes in turns]
    assert seen == [[False, False], [True, True], [True, True]]
    retrieved = {n.node.metadata["chunk_id"] for n in turns[0]}
    assert retrieved <= {chunk_id(text) for text in FACTS}
    answered = [r for r in backend_of(llm).requests if chunk_ids(r)]
    assert len(answered) == 3 and all(set(chunk_ids(r)) == retrieved for r in answered)
    other = chat_engine(index, llm, mode, conversation_id="user-7")
    assert [n.node.metadata["seen_in_conversation"] for n in other.chat("Hi").source_nodes] == [
        False,
        False,
    ]


# --- recipe 4: postprocessors that change a node's text ---------------------------------

SENTENCES = {
    "dumps": "The json module serializes Python objects to JSON text with json.dumps.",
    "loads": "It parses JSON text back into Python objects with json.loads.",
}
SECTION = f"Section 3. {SENTENCES['dumps']} {SENTENCES['loads']} Both take indent options."


class Sentences(BaseRetriever):
    """The sentence the query names, its section in the metadata (sentence-window style)."""

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        text = SENTENCES[query_bundle.query_str]
        node = TextNode(text=text, metadata={"section": SECTION})
        node.excluded_llm_metadata_keys.append("section")
        return [NodeWithScore(node=node, score=1.0)]


def section_engine(llm: ChunkCacheLLM, *, wrapped: bool) -> RetrieverQueryEngine:
    """A query engine that replaces each node's text with its section, planned after that."""
    base = Sentences()
    retriever = ChunkCacheRetriever(base, cache=llm.cache) if wrapped else base
    return RetrieverQueryEngine.from_args(
        retriever,
        llm=llm,
        node_postprocessors=[
            MetadataReplacementPostProcessor(target_metadata_key="section"),
            ChunkCachePostprocessor(cache=llm.cache),
        ],
    )


@pytest.mark.parametrize("wrapped", [True, False])
def test_a_replaced_text_gets_its_own_id_whichever_node_it_replaced(wrapped: bool) -> None:
    """Behind a ChunkCacheRetriever, the section's id was derived from the replaced
    sentence's: the same section under another id per sentence, a miss every time."""
    llm = make_llm()
    engine = section_engine(llm, wrapped=wrapped)
    responses = [engine.query(q) for q in ("dumps", "loads")]
    ids = [[n.node.metadata["chunk_id"] for n in r.source_nodes] for r in responses]
    assert ids == [[chunk_id(SECTION)]] * 2
    assert [chunk_ids(r) for r in backend_of(llm).requests] == ids


def test_without_a_postprocessor_after_the_replacement_the_retrieved_text_is_the_chunk() -> None:
    """The retriever's chunk is the sentence: found where it stands in the section."""
    llm = make_llm()
    engine = RetrieverQueryEngine.from_args(
        ChunkCacheRetriever(Sentences(), cache=llm.cache),
        llm=llm,
        node_postprocessors=[MetadataReplacementPostProcessor(target_metadata_key="section")],
    )
    (node,) = engine.query("dumps").source_nodes
    assert node.node.get_content() == SECTION
    assert chunk_ids(backend_of(llm).requests[0]) == [chunk_id(SENTENCES["dumps"])]


# --- recipe 2: as_query_engine in each response mode --------------------------------------


def ask(engine: Any, how: str) -> str:
    """The engine's answer to one question, asked ``how``: sync, stream, aquery or astream."""
    if how == "sync":
        return str(engine.query("What do the modules do?"))
    if how == "stream":
        return "".join(engine.query("What do the modules do?").response_gen)

    async def asked() -> str:
        response = await engine.aquery("What do the modules do?")
        if how == "aquery":
            return str(response)
        return "".join([token async for token in response.async_response_gen()])

    return asyncio.run(asked())


@pytest.mark.parametrize("how", ["sync", "stream", "aquery", "astream"])
@pytest.mark.parametrize("mode", ["compact", "refine", "tree_summarize", "simple_summarize"])
def test_each_prompt_of_a_query_engine_has_its_chunks_found(
    mode: str, how: str, llm_stats: list[dict[str, Any]]
) -> None:
    """Refine's prompts hold one chunk (and the answer so far) each; the others all."""
    llm = make_llm()
    retriever = ChunkCacheRetriever(facts_index().as_retriever(similarity_top_k=3), cache=llm.cache)
    engine = RetrieverQueryEngine.from_args(
        retriever, llm=llm, response_mode=ResponseMode(mode), streaming=how in ("stream", "astream")
    )
    assert ask(engine, how)
    requests = backend_of(llm).requests
    for request in requests:
        prompt = "".join(segment.text for segment in request.segments)
        assert sorted(chunk_ids(request)) == sorted(chunk_id(t) for t in FACTS if t in prompt)
    found = [cid for request in requests for cid in chunk_ids(request)]
    assert len(found) == 3 and len(requests) == (3 if mode == "refine" else 1)
    assert [call["chunk_misses"] for call in llm_stats] == [len(chunk_ids(r)) for r in requests]


# --- recipe 3: CitationQueryEngine ------------------------------------------------------


@pytest.mark.parametrize(("citation_chunk_size", "found"), [(512, 0), (1024, 3)])
def test_citation_sources_are_chunks_while_a_node_fits_one_source(
    citation_chunk_size: int, found: int
) -> None:
    """CitationQueryEngine re-splits each node into "Source N:" nodes of at most
    ``citation_chunk_size`` tokens: a node that fits one is a chunk inside it, one split
    into several is plain text, without a warning."""
    long_facts = [" ".join([fact] * 30) for fact in FACTS]  # ~600 tokens each
    backend = FakeBackend()
    backend.context_window = 8192  # all three sources in one prompt
    llm = make_llm(backend)
    index = facts_index(long_facts)
    engine = CitationQueryEngine.from_args(
        index,
        llm=llm,
        retriever=ChunkCacheRetriever(index.as_retriever(similarity_top_k=3), cache=llm.cache),
        citation_chunk_size=citation_chunk_size,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        response = engine.query("What do the modules do?")
    (request,) = backend.requests
    assert str(response) and len(chunk_ids(request)) == found
    assert response.source_nodes[0].node.get_content().startswith("Source 1:\n")
    assert set(chunk_ids(request)) <= {chunk_id(text) for text in long_facts}

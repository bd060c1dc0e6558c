"""The LCEL RAG chain, ``RunnableParallel({"context": retriever | format_docs, "question":
RunnablePassthrough()}) | prompt | llm``, run on many questions at once (``batch``,
``abatch``, concurrent ``astream_events``), each in its own conversation, on one engine:
every item's prompt, stats and conversation are its own."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableConfig, RunnableParallel, RunnablePassthrough
from test_langchain_recipes_s27 import (
    FACTS,
    RecordingBackend,
    engine_cache,
    fact_store,
    tiny_smollm2,
)

from chunkcache.core import ChunkCache
from chunkcache.core.models import LoadedModel
from chunkcache.integrations.langchain import ChunkCacheLLM, ChunkCacheRetriever

ITEMS = range(8)
EVENTS = ("on_chat_model_start", "on_chat_model_stream", "on_chat_model_end", "on_chain_end")


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_smollm2()


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(doc.page_content for doc in docs)


def rag_chain(cache: ChunkCache) -> Any:
    retriever = ChunkCacheRetriever(
        base_retriever=fact_store().as_retriever(search_kwargs={"k": 2}), cache=cache
    )
    prompt = ChatPromptTemplate.from_messages(
        [("human", "Context:\n{context}\n\nQuestion: {question}")]
    )
    llm = ChunkCacheLLM(chunk_cache=cache, max_tokens=4)
    context = RunnableParallel(
        {"context": retriever | format_docs, "question": RunnablePassthrough()}
    )
    return context | prompt | llm


def question(item: int, turn: int) -> str:
    return f"user {item}: item {item + turn} and item {item + turn + 1}?"


def configs() -> list[RunnableConfig]:
    return [RunnableConfig(configurable={"session_id": f"u{item}"}) for item in ITEMS]


def assert_each_item_its_own(
    cache: ChunkCache, answers: list[AIMessage], turn: int, sent_before: int
) -> None:
    """Each answer's stats count its own prompt's two chunks, and each request sent its own
    question, its facts, under its own conversation."""
    backend = cache.backend
    assert isinstance(backend, RecordingBackend)
    sent = dict(backend.sent()[sent_before:])
    assert len(sent) == len(ITEMS)
    for item, answer in zip(ITEMS, answers, strict=True):
        prompt = sent[f"u{item}"]
        assert question(item, turn) in prompt
        assert FACTS[item + turn] in prompt and FACTS[item + turn + 1] in prompt
        stats = answer.response_metadata["chunkcache"]
        assert stats["chunk_hits"] + stats["chunk_misses"] == 2
        assert answer.usage_metadata is not None
        assert answer.usage_metadata["input_tokens"] == stats["prompt_tokens"]


def test_batch_then_abatch_keep_each_items_conversation(lm: LoadedModel) -> None:
    cache = engine_cache(lm)
    chain = rag_chain(cache)
    answers = chain.batch([question(item, 0) for item in ITEMS], config=configs())
    assert_each_item_its_own(cache, answers, turn=0, sent_before=0)
    follow_ups = [question(item, 1) for item in ITEMS]
    answers = asyncio.run(chain.abatch(follow_ups, config=configs()))
    assert_each_item_its_own(cache, answers, turn=1, sent_before=len(ITEMS))
    for item in ITEMS:
        assert len(cache.ledger.seen(f"u{item}")) == 3  # two turns, one fact in common


def test_the_retriever_marks_what_each_items_own_conversation_saw(lm: LoadedModel) -> None:
    cache = engine_cache(lm)
    retriever = ChunkCacheRetriever(
        base_retriever=fact_store().as_retriever(search_kwargs={"k": 2}), cache=cache
    )
    retriever.batch([question(item, 0) for item in ITEMS], config=configs())
    second = retriever.batch([question(item, 1) for item in ITEMS], config=configs())
    for item, docs in zip(ITEMS, second, strict=True):
        marks = {doc.page_content: doc.metadata["seen_in_conversation"] for doc in docs}
        assert marks == {FACTS[item + 1]: True, FACTS[item + 2]: False}


async def test_concurrent_astream_events_report_each_items_own_run(lm: LoadedModel) -> None:
    cache = engine_cache(lm)
    chain = rag_chain(cache) | StrOutputParser()

    async def events(item: int) -> list[dict[str, Any]]:
        stream = chain.astream_events(question(item, 0), config=configs()[item], version="v2")
        return [dict(event) async for event in stream]

    streams = await asyncio.gather(*(events(item) for item in ITEMS))
    backend = cache.backend
    assert isinstance(backend, RecordingBackend)
    sent = dict(backend.sent())
    for item, items_events in zip(ITEMS, streams, strict=True):
        by_kind = {kind: [e for e in items_events if e["event"] == kind] for kind in EVENTS}
        (start,) = by_kind["on_chat_model_start"]
        (end,) = by_kind["on_chat_model_end"]
        assert question(item, 0) in str(start["data"]["input"])
        answer = end["data"]["output"]
        assert isinstance(answer, AIMessageChunk | AIMessage)
        pieces = "".join(str(e["data"]["chunk"].content) for e in by_kind["on_chat_model_stream"])
        assert pieces == answer.content
        (final,) = by_kind["on_chain_end"][-1:]
        assert final["data"]["output"] == answer.content
        assert answer.usage_metadata is not None
        stats = answer.response_metadata["chunkcache"]
        assert answer.usage_metadata["input_tokens"] == stats["prompt_tokens"]
        assert stats["chunk_hits"] + stats["chunk_misses"] == 2
        assert question(item, 0) in sent[f"u{item}"]

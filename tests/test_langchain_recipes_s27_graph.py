"""LangGraph RAG apps on chunkcache: a ``StateGraph`` whose retrieve node calls a
``ChunkCacheRetriever`` and whose generate node calls a ``ChunkCacheLLM``, checkpointed per
``thread_id`` by ``InMemorySaver``; the nodes pass no config, as LangGraph's tutorials write
them, and the thread still reaches both."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from test_langchain_recipes_s27 import (
    FACTS,
    RecordingBackend,
    Runs,
    engine_cache,
    fact_store,
    tiny_smollm2,
)

from chunkcache.core import ChunkCache
from chunkcache.core.ledger import DedupeMode
from chunkcache.core.models import LoadedModel
from chunkcache.integrations.langchain import ChunkCacheLLM, ChunkCacheRetriever
from chunkcache.integrations.langchain_history import format_turn

graph = pytest.importorskip("langgraph.graph")
memory = pytest.importorskip("langgraph.checkpoint.memory")

QUESTIONS = ["item 1 and item 2?", "item 2 and item 3?", "item 3 and item 1?"]


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_smollm2()


def thread(thread_id: str, runs: Runs | None = None) -> RunnableConfig:
    return RunnableConfig(configurable={"thread_id": thread_id}, callbacks=[runs or Runs()])


def retriever_on(cache: ChunkCache, dedupe: DedupeMode = "mark") -> ChunkCacheRetriever:
    return ChunkCacheRetriever(
        base_retriever=fact_store().as_retriever(search_kwargs={"k": 2}),
        cache=cache,
        dedupe=dedupe,
    )


class ContextState(graph.MessagesState):  # type: ignore[name-defined]
    context: list[Document]


def tutorial_app(cache: ChunkCache) -> Any:
    """LangGraph's RAG tutorial: the retrieved documents in the state, joined into the system
    message of the generate call, before the conversation's messages."""
    retriever = retriever_on(cache)
    llm = ChunkCacheLLM(chunk_cache=cache, max_tokens=4)

    def retrieve(state: ContextState) -> dict[str, Any]:
        return {"context": retriever.invoke(state["messages"][-1].content)}

    def generate(state: ContextState) -> dict[str, Any]:
        context = "\n\n".join(doc.page_content for doc in state["context"])
        system = SystemMessage(f"Answer from the context.\n\n{context}")
        return {"messages": [llm.invoke([system, *state["messages"]])]}

    return compiled(ContextState, retrieve, generate)


def compiled(state: Any, retrieve: Any, generate: Any) -> Any:
    builder = graph.StateGraph(state)
    builder.add_node("retrieve", retrieve)
    builder.add_node("generate", generate)
    builder.add_edge(graph.START, "retrieve")
    builder.add_edge("retrieve", "generate")
    builder.add_edge("generate", graph.END)
    return builder.compile(checkpointer=memory.InMemorySaver())


def seen_as_expected(contexts: list[list[Document]]) -> bool:
    """Each turn's documents are marked seen exactly when an earlier turn retrieved them."""
    earlier: set[str] = set()
    for docs in contexts:
        if any(doc.metadata["seen_in_conversation"] != (doc.id in earlier) for doc in docs):
            return False
        earlier |= {str(doc.id) for doc in docs}
    return True


def test_the_thread_id_dedupes_per_thread_and_names_the_llms_conversation(
    lm: LoadedModel,
) -> None:
    cache = engine_cache(lm)
    app = tutorial_app(cache)
    contexts: dict[str, list[list[Document]]] = {"A": [], "B": []}
    for question in QUESTIONS:
        for thread_id in ("A", "B"):  # B asks each question after A did
            state = app.invoke({"messages": [HumanMessage(question)]}, config=thread(thread_id))
            contexts[thread_id].append(state["context"])
    assert all(seen_as_expected(turns) for turns in contexts.values())
    assert [doc.page_content for doc in contexts["B"][0]] == FACTS[1:3]
    assert not any(doc.metadata["seen_in_conversation"] for doc in contexts["B"][0])
    backend = cache.backend
    assert isinstance(backend, RecordingBackend)
    assert [conversation for conversation, _ in backend.sent()] == ["A", "B"] * 3
    state = app.get_state(thread("A")).values
    assert len(state["messages"]) == 6
    assert state["messages"][-1].usage_metadata["input_tokens"] > 0  # checkpointed as sent


def layout_app(cache: ChunkCache) -> Any:
    """CRAFT's multi-turn layout in a graph: the retrieve node replaces the question by its
    turn's message (this turn's new chunks, then the question), so each prompt is the last
    one plus its answer plus one message."""
    retriever = retriever_on(cache, dedupe="drop")
    llm = ChunkCacheLLM(chunk_cache=cache, max_tokens=4)

    def retrieve(state: graph.MessagesState) -> dict[str, Any]:  # type: ignore[name-defined]
        asked = state["messages"][-1]
        docs = retriever.invoke(asked.content)
        return {"messages": [HumanMessage(format_turn(asked.content, docs), id=asked.id)]}

    def generate(state: graph.MessagesState) -> dict[str, Any]:  # type: ignore[name-defined]
        system = SystemMessage("Answer from the context.")
        return {"messages": [llm.invoke([system, *state["messages"]])]}

    return compiled(graph.MessagesState, retrieve, generate)


def test_with_each_turns_chunks_in_its_message_a_thread_reuses_its_whole_past(
    lm: LoadedModel,
) -> None:
    cache = engine_cache(lm)
    app = layout_app(cache)
    runs = Runs()
    for question in QUESTIONS:
        app.invoke({"messages": [HumanMessage(question)]}, config=thread("A", runs))
    app.invoke({"messages": [HumanMessage(QUESTIONS[0])]}, config=thread("B", runs))
    for before, after in zip(runs.llm, runs.llm[1:3], strict=False):
        assert after.stats["reused_tokens"] >= before.stats["prompt_tokens"]
    last_of_a, first_of_b = runs.llm[2].text, runs.llm[3].text
    assert [last_of_a.count(fact) for fact in FACTS[1:4]] == [1, 1, 1]  # each chunk sent once
    assert [first_of_b.count(fact) for fact in FACTS[1:3]] == [1, 1]  # another thread's own
    assert runs.llm[3].stats["chunk_hits"] == 2


async def test_threads_run_at_once_keep_their_own_conversations(lm: LoadedModel) -> None:
    cache = engine_cache(lm)
    retriever = retriever_on(cache)
    llm = ChunkCacheLLM(chunk_cache=cache, max_tokens=4)

    async def retrieve(state: ContextState) -> dict[str, Any]:
        return {"context": await retriever.ainvoke(state["messages"][-1].content)}

    async def generate(state: ContextState) -> dict[str, Any]:
        context = "\n\n".join(doc.page_content for doc in state["context"])
        system = SystemMessage(f"Answer from the context.\n\n{context}")
        return {"messages": [await llm.ainvoke([system, *state["messages"]])]}

    app = compiled(ContextState, retrieve, generate)
    threads = [f"T{i}" for i in range(4)]
    contexts: dict[str, list[list[Document]]] = {t: [] for t in threads}
    for turn in range(2):

        async def ask(thread_id: str, turn: int = turn) -> None:
            question = f"item {int(thread_id[1:]) + turn} and item {int(thread_id[1:]) + 5}?"
            state = await app.ainvoke(
                {"messages": [HumanMessage(question)]}, config=thread(thread_id)
            )
            contexts[thread_id].append(state["context"])

        await asyncio.gather(*(ask(t) for t in threads))
    assert all(seen_as_expected(turns) for turns in contexts.values())
    backend = cache.backend
    assert isinstance(backend, RecordingBackend)
    for conversation, prompt in backend.sent():
        assert conversation is not None
        assert f"item {int(conversation[1:]) + 5}?" in prompt

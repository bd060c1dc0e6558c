"""The benchmark's two LangChain apps keep their conversations (fake backend, no model)."""

from __future__ import annotations

import asyncio

from fake_backend import DEFAULT_ANSWER, FakeBackend
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig

from chunkcache.core.bench.rag_chains import Histories, rag_chain
from chunkcache.core.cache import ChunkCache
from chunkcache.integrations.langchain_llm import ChunkCacheLLM

FACTS = [f"Fact {i}: the value of item {i} is {i * 7}." for i in range(6)]


class FactRetriever(BaseRetriever):
    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        start = int(query.split()[-1])
        return [Document(page_content=fact) for fact in FACTS[start : start + 2]]


def test_the_plain_app_keeps_questions_and_answers_and_sends_them_next_turn() -> None:
    backend = FakeBackend()
    cache = ChunkCache(backend=backend)
    histories = Histories()
    llm = ChunkCacheLLM(chunk_cache=cache)
    chain = rag_chain("plain", llm, FactRetriever(), cache, histories=histories)
    config = RunnableConfig(configurable={"session_id": "s1"})
    chain.invoke({"question": "about 0"}, config)
    asyncio.run(chain.ainvoke({"question": "about 2"}, config))
    second = backend.requests[-1]
    prompt = "".join(segment.text for segment in second.segments)
    assert "about 0" in prompt and DEFAULT_ANSWER in prompt  # the first turn, as history
    assert FACTS[2] in prompt and FACTS[0] not in prompt  # only this turn's context
    answer = chain.invoke(
        {"question": "about 4"}, RunnableConfig(configurable={"session_id": "s2"})
    )
    assert isinstance(answer, AIMessage)
    assert len(histories.by_session["s2"].messages) == 2  # sessions kept apart
    turns = [(type(m), m.text) for m in histories.by_session["s1"].messages]
    assert turns == [
        (HumanMessage, "about 0"),
        (AIMessage, DEFAULT_ANSWER),
        (HumanMessage, "about 2"),
        (AIMessage, DEFAULT_ANSWER),
    ]

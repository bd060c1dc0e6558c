"""LangChain apps as users build them, on the fake backend: long session keys, a history
that another (reasoning) model wrote."""

from __future__ import annotations

import pytest
from fake_backend import FakeBackend
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig, RunnableLambda, RunnablePassthrough
from test_langchain_history import TEXTS, WindowRetriever

from chunkcache.core import ChunkCache
from chunkcache.integrations.langchain import (
    ChunkCacheLLM,
    ChunkCacheRetriever,
    conversation_id_from_config,
)
from chunkcache.integrations.langchain_history import (
    InMemoryChatHistory,
    chunk_chat_prompt,
    with_chunk_history,
)

LONG_SESSION = "tenant-7:user-42:" + "f" * 300  # e.g. a signed session token


def fake_llm() -> ChunkCacheLLM:
    return ChunkCacheLLM(chunk_cache=ChunkCache(backend=FakeBackend()))


def requests_of(llm: ChunkCacheLLM) -> FakeBackend:
    backend = llm.chunk_cache.backend
    assert isinstance(backend, FakeBackend)
    return backend


def test_a_chat_with_a_long_session_key_answers_with_chunkcaches_llm() -> None:
    llm = fake_llm()
    retriever = ChunkCacheRetriever(
        base_retriever=WindowRetriever(), cache=llm.chunk_cache, dedupe="drop"
    )
    histories: dict[str, InMemoryChatHistory] = {}
    chat = with_chunk_history(
        chunk_chat_prompt("Answer from the context.") | llm,
        retriever,
        lambda session_id: histories.setdefault(session_id, InMemoryChatHistory()),
    )
    config = RunnableConfig(configurable={"session_id": LONG_SESSION})
    for question in ("0", "1"):
        chat.invoke({"question": question}, config=config)
    requests = requests_of(llm).requests
    (conversation,) = {request.conversation_id for request in requests}
    assert conversation is not None and len(conversation) <= 256
    assert retriever.cache.ledger.seen(conversation)  # the retriever's conversation too
    assert len(histories[LONG_SESSION].messages) == 4
    second = "".join(segment.text for segment in requests[-1].segments)
    assert [second.count(fact) for fact in TEXTS[:4]] == [1, 1, 1, 1]


@pytest.mark.parametrize("key", ["session_id", "thread_id"])
def test_a_long_session_key_in_config_names_one_conversation_on_both_sides(key: str) -> None:
    llm = fake_llm()
    retriever = ChunkCacheRetriever(
        base_retriever=WindowRetriever(), cache=llm.chunk_cache, dedupe="drop"
    )
    prompt = ChatPromptTemplate.from_messages([("human", "{context}\n\n{question}")])

    def join(docs: list[Document]) -> str:
        return "\n".join(doc.page_content for doc in docs)

    chain = {"context": retriever | RunnableLambda(join), "question": RunnablePassthrough()}
    config = RunnableConfig(configurable={key: LONG_SESSION})
    (chain | prompt | llm).invoke("0", config=config)
    docs = retriever.invoke("1", config=config)
    assert [doc.page_content for doc in docs] == [TEXTS[3]]  # facts 1-2 were sent
    conversation = conversation_id_from_config(config)
    assert conversation is not None and len(conversation) <= 256
    assert requests_of(llm).requests[-1].conversation_id == conversation
    short = RunnableConfig(configurable={key: "user-42"})
    assert conversation_id_from_config(short) == "user-42"  # short keys are kept as they are


def test_a_history_with_another_models_reasoning_sends_its_text_alone() -> None:
    llm = fake_llm()
    earlier_answer = AIMessage(
        content=[
            {"type": "reasoning", "reasoning": "The user wants a greeting."},
            {"type": "thinking", "thinking": "Keep it short.", "signature": "c2ln"},
            {"type": "redacted_thinking", "data": "ZW5j"},
            {"type": "text", "text": "Hello!"},
        ]
    )
    question = HumanMessage("and?")
    llm.invoke([SystemMessage("Be brief."), HumanMessage("hi"), earlier_answer, question])
    (segment,) = requests_of(llm).requests[-1].segments
    assert segment.text == FakeBackend().render_chat(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "and?"},
        ]
    )


class KeepUpTo(BaseRetriever):
    """A compressor as langchain-classic's ``ContextualCompressionRetriever`` is one: it wraps
    ``base_retriever`` and keeps the facts numbered up to the query + 1."""

    base_retriever: BaseRetriever

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        docs = self.base_retriever.invoke(query, config={"callbacks": run_manager.get_child()})
        return [doc for doc in docs if int(doc.page_content.split()[1][:-1]) <= int(query) + 1]


def test_a_chunk_a_compressor_filtered_out_is_sent_when_it_comes_back() -> None:
    """Turn 1 retrieves facts 0-2 and the compressor keeps 0-1; turn 2 retrieves 2-4 and
    keeps 2-3. The drop wrapper inside the compressor must not drop fact 2 as already sent."""
    llm = fake_llm()
    inner = ChunkCacheRetriever(
        base_retriever=WindowRetriever(), cache=llm.chunk_cache, dedupe="drop"
    )
    history = InMemoryChatHistory()
    chat = with_chunk_history(
        chunk_chat_prompt("Answer from the context.") | llm,
        KeepUpTo(base_retriever=inner),
        lambda session_id: history,
    )
    config = RunnableConfig(configurable={"session_id": "s"})
    for question in ("0", "2"):
        chat.invoke({"question": question}, config=config)
    second = "".join(segment.text for segment in requests_of(llm).requests[-1].segments)
    assert [second.count(fact) for fact in TEXTS[:5]] == [1, 1, 1, 1, 0]


@pytest.mark.parametrize("stream", [True, False])
def test_langchain_cores_stream_flag_is_taken(stream: bool) -> None:
    llm = fake_llm()
    assert llm.invoke("hello", stream=stream).content

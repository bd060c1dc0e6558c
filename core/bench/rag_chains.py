"""The two LangChain RAG apps a benchmark system runs: plain, and laid out for chunkcache.

- ``plain``: what an app does without chunkcache: chunks in the retriever's order, this
  turn's context in the system message, the history after it (so what changes each turn
  sits before what stays).
- ``chunkcache``: :class:`ChunkCacheRetriever` ordering (tree) and dedupe (drop), and the
  multi-turn layout of :func:`with_chunk_history` (CRAFT §4.3).

Both wrap the same base retriever in a :class:`ChunkCacheRetriever` (``plain`` with
``ordering="retriever"`` and ``dedupe="off"``) so the LLM side can find the chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda, RunnablePassthrough

from chunkcache.core.cache import ChunkCache
from chunkcache.core.chunk_ids import CHUNK_ID_METADATA_KEY
from chunkcache.integrations.langchain import ChunkCacheRetriever
from chunkcache.integrations.langchain_chat_turns import (
    SESSION_ID,
    ChatTurns,
    InMemoryChatHistory,
    SessionHistory,
    Turn,
    history_lookup,
)
from chunkcache.integrations.langchain_history import (
    DEFAULT_DOCUMENT_SEPARATOR,
    chunk_chat_prompt,
    with_chunk_history,
)

Layout = Literal["plain", "chunkcache"]
LAYOUTS: tuple[Layout, ...] = ("plain", "chunkcache")
SYSTEM_PROMPT = (
    "You are a concise assistant. Answer the question in one or two sentences, using only "
    "the context."
)


class RetrievedChunks(BaseCallbackHandler):
    """Notes the chunk ids each invocation's outermost retriever returned."""

    def __init__(self) -> None:
        self.chunk_ids: list[str] = []

    def on_retriever_end(
        self, documents: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        ids = [doc.metadata.get(CHUNK_ID_METADATA_KEY) for doc in documents]
        if all(isinstance(i, str) for i in ids):  # the wrapper's output; it ends last
            self.chunk_ids = [str(i) for i in ids]


class Histories:
    """In-memory chat histories by session id."""

    def __init__(self) -> None:
        self.by_session: dict[str, InMemoryChatHistory] = {}

    def __call__(self, session_id: str) -> InMemoryChatHistory:
        return self.by_session.setdefault(session_id, InMemoryChatHistory())


def rag_chain(
    layout: Layout,
    llm: BaseChatModel,
    base_retriever: BaseRetriever,
    cache: ChunkCache,
    system_prompt: str = SYSTEM_PROMPT,
    histories: Histories | None = None,
) -> Runnable[dict[str, Any], Any]:
    """A multi-turn RAG chain: invoke with ``{"question": ...}`` and a ``session_id``;
    its conversations are kept in ``histories`` (new ones if None)."""
    histories = histories if histories is not None else Histories()
    if layout == "chunkcache":
        retriever = ChunkCacheRetriever(
            base_retriever=base_retriever, cache=cache, ordering="tree", dedupe="drop"
        )
        return with_chunk_history(chunk_chat_prompt(system_prompt) | llm, retriever, histories)
    if layout != "plain":
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    retriever = ChunkCacheRetriever(
        base_retriever=base_retriever, cache=cache, ordering="retriever", dedupe="off"
    )
    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", system_prompt.replace("{", "{{").replace("}", "}}") + "\n\n{context}"),
            MessagesPlaceholder("history"),
            ("human", "{question}"),
        ]
    )
    context = RunnableLambda(_context_of(retriever))
    chain = RunnablePassthrough.assign(context=context) | prompt | llm
    return _with_plain_history(chain, histories)


def _with_plain_history(
    chain: Runnable[dict[str, Any], Any], histories: Histories
) -> Runnable[dict[str, Any], Any]:
    """``chain`` given the session's earlier messages under ``history``; each turn saves
    the question and the answer (what ``RunnableWithMessageHistory`` did, deprecated)."""
    history_of = history_lookup(histories, [SESSION_ID.id])

    def turn(history: SessionHistory, earlier: list[BaseMessage], inputs: dict[str, Any]) -> Turn:
        asked: list[BaseMessage] = [HumanMessage(inputs["question"])]
        return Turn(history, {**inputs, "history": earlier}, asked)

    def start(inputs: dict[str, Any], config: RunnableConfig) -> Turn:
        history = history_of(config)
        return turn(history, list(history.messages), inputs)

    async def astart(inputs: dict[str, Any], config: RunnableConfig) -> Turn:
        history = history_of(config)
        return turn(history, await history.aget_messages(), inputs)

    specs = [*chain.config_specs, SESSION_ID]
    return ChatTurns(chain, start, astart, None, specs, name="plain_chat_history")


def _context_of(retriever: BaseRetriever) -> Callable[[dict[str, Any], RunnableConfig], str]:
    def context(inputs: dict[str, Any], config: RunnableConfig) -> str:
        documents: list[Document] = retriever.invoke(inputs["question"], config)
        return "Context:\n" + DEFAULT_DOCUMENT_SEPARATOR.join(d.page_content for d in documents)

    return context

"""CRAFT §4.3's multi-turn layout for LangChain chat chains.

``RunnableWithMessageHistory`` normally stores only the user's question, and a
typical RAG prompt puts this turn's context before the history or in the system
message.  Both break chunk reuse across turns: the chunks of turn t vanish from
the prompt of turn t+1 (so dropping repeats would lose them), and whatever
changes each turn sits before what stays.

:func:`with_chunk_history` stores each turn's *new* chunks inside that turn's
user message, so the prompt of turn t+1 is exactly the prompt of turn t, plus
its answer, plus one new user message::

    system | user(chunks_1 + q_1) | ai(a_1) | user(chunks_2 + q_2) | ...

With this layout ``dedupe="drop"`` is safe: every chunk the conversation has
seen is still in the prompt.  It stops being safe when the history is trimmed
or cleared: call ``cache.ledger.forget(session_id)`` when you do that.

>>> chain = with_chunk_history(  # doctest: +SKIP
...     chunk_chat_prompt("Answer from the context.") | llm,
...     ChunkCacheRetriever(base_retriever=base, dedupe="drop"),
...     get_session_history,
... )
>>> chain.invoke({"question": "What is json.dumps?"},  # doctest: +SKIP
...              config={"configurable": {"session_id": "user-42"}})
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from langchain_core.chat_history import BaseChatMessageHistory
from langchain_core.documents import Document
from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda, RunnablePassthrough
from langchain_core.runnables.history import RunnableWithMessageHistory

__all__ = [
    "DEFAULT_TURN_TEMPLATE",
    "chunk_chat_prompt",
    "format_turn",
    "with_chunk_history",
]

DEFAULT_TURN_TEMPLATE = "Context:\n{context}\n\nQuestion: {question}"
DEFAULT_DOCUMENT_SEPARATOR = "\n\n"


def format_turn(
    question: str,
    documents: list[Document],
    template: str = DEFAULT_TURN_TEMPLATE,
    separator: str = DEFAULT_DOCUMENT_SEPARATOR,
) -> str:
    """One turn's user message: this turn's new chunks, verbatim, then the question.

    Chunk texts are inserted unchanged so the LLM side can find them by exact match.
    With no new chunks (all already in the conversation) only the question remains.
    """
    if not documents:
        return question
    context = separator.join(doc.page_content for doc in documents)
    return template.format(context=context, question=question)


def chunk_chat_prompt(
    system_prompt: str, *, history_key: str = "history", turn_key: str = "turn"
) -> ChatPromptTemplate:
    """A chat prompt in the multi-turn layout: fixed system message, history, this turn."""
    return ChatPromptTemplate.from_messages(
        [
            ("system", system_prompt),
            MessagesPlaceholder(history_key),
            MessagesPlaceholder(turn_key),
        ]
    )


def with_chunk_history(
    chain: Runnable[dict[str, Any], Any],
    retriever: BaseRetriever,
    get_session_history: Callable[..., BaseChatMessageHistory],
    *,
    question_key: str = "question",
    history_key: str = "history",
    turn_key: str = "turn",
    turn_template: str = DEFAULT_TURN_TEMPLATE,
    document_separator: str = DEFAULT_DOCUMENT_SEPARATOR,
    **history_kwargs: Any,
) -> Runnable[dict[str, Any], Any]:
    """Wrap ``chain`` so each turn's chunks are stored in that turn's user message.

    ``chain`` receives the input dict plus ``history_key`` (earlier messages) and
    ``turn_key`` (a one-message list holding this turn's chunks and question); see
    :func:`chunk_chat_prompt`.  The conversation id is the ``session_id`` that
    ``RunnableWithMessageHistory`` reads, passed to the retriever in the config.
    Extra keyword arguments go to ``RunnableWithMessageHistory``.
    """

    def turn_messages(documents: list[Document], question: str) -> list[BaseMessage]:
        text = format_turn(question, documents, turn_template, document_separator)
        return [HumanMessage(content=text)]

    def build_turn(inputs: dict[str, Any], config: RunnableConfig) -> list[BaseMessage]:
        question = inputs[question_key]
        return turn_messages(retriever.invoke(question, config), question)

    async def abuild_turn(inputs: dict[str, Any], config: RunnableConfig) -> list[BaseMessage]:
        question = inputs[question_key]
        return turn_messages(await retriever.ainvoke(question, config), question)

    with_history = RunnableWithMessageHistory(
        chain,
        get_session_history,
        input_messages_key=turn_key,
        history_messages_key=history_key,
        **history_kwargs,
    )
    add_turn = RunnablePassthrough.assign(
        **{turn_key: RunnableLambda(build_turn, afunc=abuild_turn)}
    )
    return add_turn | with_history

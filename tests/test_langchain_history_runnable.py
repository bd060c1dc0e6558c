"""with_chunk_history's own turn runnable: no deprecated LangChain class, and each turn
saved exactly as ``RunnableWithMessageHistory`` saved it (these tests passed on that
implementation too, save the deprecation test)."""

from __future__ import annotations

import gc
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import AIMessageChunk
from langchain_core.output_parsers import StrOutputParser
from langchain_core.runnables import (
    ConfigurableFieldSpec,
    Runnable,
    RunnableConfig,
    RunnableGenerator,
    RunnableLambda,
)
from test_langchain_history import TEXTS, WindowRetriever

from chunkcache.core import ChunkCache
from chunkcache.core.chunk_ids import chunk_id
from chunkcache.integrations.langchain import ChunkCacheRetriever
from chunkcache.integrations.langchain_history import (
    InMemoryChatHistory,
    chunk_chat_prompt,
    with_chunk_history,
)

CONFIG = RunnableConfig(configurable={"session_id": "s"})


class Chat:
    """A chat over :class:`WindowRetriever` whose model answers "answer 0", "answer 1", ..."""

    def __init__(self, tail: Runnable[Any, Any] | None = None, **options: Any) -> None:
        self.histories: dict[str, InMemoryChatHistory] = {}
        self.inputs: list[dict[str, Any]] = []
        chain = (
            RunnableLambda(self._record)
            | chunk_chat_prompt("Answer.")
            | FakeListChatModel(responses=[f"answer {i}" for i in range(10)])
        )
        retriever = ChunkCacheRetriever(
            base_retriever=WindowRetriever(),
            cache=ChunkCache(),
            dedupe="drop",
            ordering="retriever",
        )
        self.chain = with_chunk_history(
            chain if tail is None else chain | tail,
            retriever,
            lambda session_id: self.histories.setdefault(session_id, InMemoryChatHistory()),
            **options,
        )

    def _record(self, inputs: dict[str, Any]) -> dict[str, Any]:
        self.inputs.append(inputs)
        return inputs

    def saved(self, session_id: str = "s") -> list[tuple[str, Any, dict[str, Any]]]:
        """The saved messages' type (``AIMessageChunk`` is its own), content and kwargs."""
        return [
            (m.type, m.content, m.additional_kwargs) for m in self.histories[session_id].messages
        ]


def user(question: str, facts: list[int]) -> tuple[str, str, dict[str, Any]]:
    context = "\n\n".join(TEXTS[i] for i in facts)
    ids = [chunk_id(TEXTS[i]) for i in facts]
    return ("human", f"Context:\n{context}\n\nQuestion: {question}", {"chunk_ids": ids})


FIRST_TURN = [user("0", [0, 1, 2]), ("ai", "answer 0", {})]
TWO_TURNS = [*FIRST_TURN, user("2", [3, 4]), ("ai", "answer 1", {})]
STREAMED_SECOND_TURN = [*FIRST_TURN, user("2", [3, 4]), ("AIMessageChunk", "answer 1", {})]


def fail_after_first_chunk(chunks: Iterator[Any]) -> Iterator[Any]:
    for chunk in chunks:
        yield chunk
        raise RuntimeError("the model failed mid-answer")


async def afail_after_first_chunk(chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for chunk in chunks:
        yield chunk
        raise RuntimeError("the model failed mid-answer")


def deprecations(caught: list[warnings.WarningMessage]) -> list[str]:
    kinds = (DeprecationWarning, PendingDeprecationWarning)
    return [str(w.message) for w in caught if issubclass(w.category, kinds)]


def test_building_and_running_a_chat_raises_no_deprecation_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chat = Chat()
        chat.chain.invoke({"question": "0"}, CONFIG)
        list(chat.chain.stream({"question": "2"}, CONFIG))
    assert deprecations(caught) == []


async def test_async_turns_raise_no_deprecation_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chat = Chat()
        await chat.chain.ainvoke({"question": "0"}, CONFIG)
        _ = [chunk async for chunk in chat.chain.astream({"question": "2"}, CONFIG)]
    assert deprecations(caught) == []


def test_sync_turns_save_the_user_message_with_its_chunk_ids_then_the_answer() -> None:
    chat = Chat()
    answers = [chat.chain.invoke({"question": q}, CONFIG) for q in ("0", "2")]
    assert chat.saved() == TWO_TURNS
    assert answers == chat.histories["s"].messages[1::2]  # the model's own messages, ids too


async def test_async_turns_save_what_sync_turns_save() -> None:
    chat = Chat()
    for question in ("0", "2"):
        await chat.chain.ainvoke({"question": question}, CONFIG)
    assert chat.saved() == TWO_TURNS


def test_a_streamed_turn_saves_the_whole_answer_once_read() -> None:
    chat = Chat()
    chat.chain.invoke({"question": "0"}, CONFIG)
    chunks = list(chat.chain.stream({"question": "2"}, CONFIG))
    assert [c.content for c in chunks] == list("answer 1")
    assert chat.saved() == STREAMED_SECOND_TURN  # the chunks added up, as before


async def test_an_async_streamed_turn_saves_the_whole_answer() -> None:
    chat = Chat()
    await chat.chain.ainvoke({"question": "0"}, CONFIG)
    chunks = [chunk async for chunk in chat.chain.astream({"question": "2"}, CONFIG)]
    assert all(isinstance(chunk, AIMessageChunk) for chunk in chunks)
    assert chat.saved() == STREAMED_SECOND_TURN


def test_a_streamed_string_answer_is_saved_as_an_ai_message() -> None:
    chat = Chat(StrOutputParser())
    chat.chain.invoke({"question": "0"}, CONFIG)
    assert "".join(chat.chain.stream({"question": "2"}, CONFIG)) == "answer 1"
    assert chat.saved() == TWO_TURNS


def test_a_dict_answer_is_saved_from_its_output_messages_key() -> None:
    chat = Chat(
        RunnableLambda(lambda m: {"answer": m, "sources": []}), output_messages_key="answer"
    )
    chat.chain.invoke({"question": "0"}, CONFIG)
    assert chat.saved() == FIRST_TURN


def test_a_batch_saves_one_turn_per_conversation() -> None:
    chat = Chat()
    configs = [
        RunnableConfig(configurable={"session_id": sid}, max_concurrency=1) for sid in ("a", "b")
    ]
    chat.chain.batch([{"question": "0"}, {"question": "0"}], configs)
    assert chat.saved("a") == FIRST_TURN
    assert chat.saved("b") == [user("0", [0, 1, 2]), ("ai", "answer 1", {})]


def test_the_chain_gets_the_earlier_messages_as_they_were_before_this_turn() -> None:
    chat = Chat()
    chat.chain.invoke({"question": "0"}, CONFIG)
    chat.chain.invoke({"question": "2"}, CONFIG)
    first, second = chat.inputs
    assert first["history"] == [] and len(second["history"]) == 2
    assert second["turn"] == chat.histories["s"].messages[2:3]


def test_a_turn_whose_chain_raises_is_not_saved() -> None:
    """As with ``RunnableWithMessageHistory``: the turn is saved only when the chain ended
    well (its run's on_end), so a failed turn leaves the history as it was."""
    chat = Chat(RunnableGenerator(fail_after_first_chunk, afail_after_first_chunk))
    with pytest.raises(RuntimeError, match="mid-answer"):
        chat.chain.invoke({"question": "0"}, CONFIG)
    with pytest.raises(RuntimeError, match="mid-answer"):
        list(chat.chain.stream({"question": "0"}, CONFIG))
    assert chat.saved() == []


async def test_an_async_turn_whose_chain_raises_is_not_saved() -> None:
    chat = Chat(RunnableGenerator(fail_after_first_chunk, afail_after_first_chunk))
    with pytest.raises(RuntimeError, match="mid-answer"):
        await chat.chain.ainvoke({"question": "0"}, CONFIG)
    with pytest.raises(RuntimeError, match="mid-answer"):
        _ = [chunk async for chunk in chat.chain.astream({"question": "0"}, CONFIG)]
    assert chat.saved() == []


def test_a_stream_closed_before_its_end_saves_nothing() -> None:
    chat = Chat()
    stream = chat.chain.stream({"question": "0"}, CONFIG)
    next(stream)
    stream.close()  # type: ignore[attr-defined]  # it is a generator
    gc.collect()  # the inner generators close when collected
    assert chat.saved() == []


async def test_an_async_stream_closed_before_its_end_saves_nothing() -> None:
    chat = Chat()
    stream = chat.chain.astream({"question": "0"}, CONFIG)
    await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]  # it is an async generator
    assert chat.saved() == []


def test_a_missing_session_id_is_an_error_naming_it() -> None:
    chat = Chat()
    with pytest.raises(ValueError, match=r"Missing keys \['session_id'\]"):
        chat.chain.invoke({"question": "0"}, RunnableConfig(configurable={}))
    assert chat.histories == {}


def test_history_factory_config_keys_must_be_factory_parameters() -> None:
    keys = [ConfigurableFieldSpec(id=key, annotation=str) for key in ("user_id", "chat_id")]
    with pytest.raises(TypeError, match="chat_id"):
        chain = with_chunk_history(
            chunk_chat_prompt("Answer.") | FakeListChatModel(responses=["a"]),
            WindowRetriever(),
            lambda user_id, thread_id: InMemoryChatHistory(),
            history_factory_config=keys,
        )
        chain.invoke({"question": "0"}, {"configurable": {"user_id": "u", "chat_id": "c"}})


def test_the_history_keys_are_the_chains_config_specs() -> None:
    assert [spec.id for spec in Chat().chain.config_specs] == ["session_id"]

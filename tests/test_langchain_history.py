"""The multi-turn layout helper: each prompt extends the previous one, dedupe is safe."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.chat_history import InMemoryChatMessageHistory
from langchain_core.documents import Document
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.prompt_values import PromptValue
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import (
    ConfigurableFieldSpec,
    Runnable,
    RunnableConfig,
    RunnableLambda,
)

from chunkcache.core import ChunkCache
from chunkcache.core.errors import InvalidConversationIdError
from chunkcache.core.ledger import DedupeMode
from chunkcache.integrations.langchain import ChunkCacheRetriever
from chunkcache.integrations.langchain_history import (
    chunk_chat_prompt,
    chunk_ids_in,
    format_turn,
    with_chunk_history,
)

TEXTS = [f"Fact {i}: the value of item {i} is {i * 7}." for i in range(12)]


class WindowRetriever(BaseRetriever):
    """The query is a start index; returns three consecutive facts."""

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        start = int(query)
        return [Document(page_content=t) for t in TEXTS[start : start + 3]]


class Conversation:
    """One LangChain chat in the multi-turn layout over :class:`WindowRetriever`."""

    def __init__(
        self,
        dedupe: DedupeMode = "drop",
        llm: Runnable[Any, Any] | None = None,
        histories: dict[str, InMemoryChatMessageHistory] | None = None,
        **layout: Any,
    ) -> None:
        self.histories = {} if histories is None else histories
        self.prompts: list[list[BaseMessage]] = []
        self.retriever = ChunkCacheRetriever(
            base_retriever=WindowRetriever(), cache=ChunkCache(), dedupe=dedupe
        )
        llm = llm or FakeListChatModel(responses=[f"answer {i}" for i in range(50)])
        self.chain = with_chunk_history(
            chunk_chat_prompt("Answer from the context.") | RunnableLambda(self._record) | llm,
            self.retriever,
            lambda sid: self.histories.setdefault(sid, InMemoryChatMessageHistory()),
            **layout,
        )

    def _record(self, prompt: PromptValue) -> PromptValue:
        self.prompts.append(prompt.to_messages())
        return prompt

    def ask(self, *questions: str) -> None:
        for question in questions:
            self.chain.invoke({"question": question}, config=CONFIG)

    def history(self) -> list[BaseMessage]:
        return self.histories["conv-1"].messages


CONFIG = RunnableConfig(configurable={"session_id": "conv-1"})


def run_conversation(questions: list[str], dedupe: DedupeMode = "drop") -> list[list[BaseMessage]]:
    conversation = Conversation(dedupe)
    conversation.ask(*questions)
    return conversation.prompts


def facts_in(prompt: list[BaseMessage]) -> list[str]:
    """The facts in ``prompt``, once per occurrence, in :data:`TEXTS` order."""
    text = "\n".join(str(m.content) for m in prompt)
    return [fact for fact in TEXTS for _ in range(text.count(fact))]


def test_each_prompt_extends_the_previous_one() -> None:
    prompts = run_conversation(["0", "2", "1"])
    for earlier, later in itertools.pairwise(prompts):
        assert [m.content for m in later[: len(earlier)]] == [m.content for m in earlier]
        assert len(later) == len(earlier) + 2  # the answer, then the new user turn


def test_drop_never_loses_a_chunk_and_never_repeats_one() -> None:
    prompts = run_conversation(["0", "2", "1", "4"])
    final = "\n".join(str(m.content) for m in prompts[-1])
    for fact in TEXTS[:7]:
        assert final.count(fact) == 1


def test_turn_without_new_chunks_is_just_the_question() -> None:
    prompts = run_conversation(["0", "0"])
    assert prompts[-1][-1].content == "0"


def test_format_turn_keeps_chunk_text_verbatim() -> None:
    docs = [Document(page_content="a  {b}\n"), Document(page_content="ü")]
    text = format_turn("why?", docs)
    assert "a  {b}\n" in text and "ü" in text and text.endswith("Question: why?")


def test_each_turn_records_its_chunk_ids_in_its_user_message() -> None:
    conversation = Conversation()
    conversation.ask("0", "2")
    recorded = chunk_ids_in(conversation.history())
    assert len(recorded) == 5  # facts 0-2, then 3-4 (fact 2 was already there)
    assert conversation.retriever.cache.ledger.seen("conv-1") == set(recorded)


def test_a_failed_turn_loses_no_chunk() -> None:
    """The retriever records a turn's chunks before the model runs; a failure must
    not leave them in the ledger, or the next turn would drop them unsent."""
    replies = iter(["answer 0", None, "answer 2"])

    def flaky(prompt: PromptValue) -> AIMessage:
        reply = next(replies)
        if reply is None:
            raise RuntimeError("the model failed")
        return AIMessage(content=reply)

    conversation = Conversation(llm=RunnableLambda(flaky))
    conversation.ask("0")
    with pytest.raises(RuntimeError):
        conversation.ask("3")
    conversation.ask("3")
    assert facts_in(conversation.prompts[-1]) == TEXTS[:6]


def test_max_history_turns_trims_oldest_turns_and_resends_their_chunks() -> None:
    conversation = Conversation(max_history_turns=2)
    conversation.ask("0", "3", "6")  # three turns: over the limit before the next one
    conversation.ask("0")
    last = conversation.prompts[-1]
    # The two oldest turns went in one step; facts 0-2 left with them and come back.
    assert facts_in(last) == TEXTS[:3] + TEXTS[6:9]
    assert len(last) == 1 + 2 + 1  # system, the kept turn and its answer, this turn
    assert all(len(prompt) <= 1 + 2 * 2 + 1 for prompt in conversation.prompts)


def test_max_history_turns_trims_in_async_chains_too() -> None:
    conversation = Conversation(max_history_turns=1)

    async def chat() -> None:
        for question in ("0", "3", "0"):
            await conversation.chain.ainvoke({"question": question}, config=CONFIG)

    asyncio.run(chat())
    assert [len(prompt) for prompt in conversation.prompts] == [2, 4, 4]
    assert facts_in(conversation.prompts[-1]) == TEXTS[:6]


def test_a_persisted_history_restores_dedupe_in_a_new_process() -> None:
    histories: dict[str, InMemoryChatMessageHistory] = {}
    Conversation(histories=histories).ask("0")
    restarted = Conversation(histories=histories)  # a fresh cache: an empty ledger
    restarted.ask("1")
    assert facts_in(restarted.prompts[-1]) == TEXTS[:4]


def test_max_history_turns_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_history_turns"):
        Conversation(max_history_turns=0)


def test_a_missing_question_key_says_which_key_it_wants() -> None:
    conversation = Conversation()
    with pytest.raises(KeyError, match="question_key"):
        conversation.chain.invoke({"query": "0"}, config=CONFIG)


def test_a_history_keyed_by_other_fields_is_the_conversation() -> None:
    """``history_factory_config`` with two keys, neither of which the retriever reads from
    the config: the keys' values name the conversation, so two users sharing one of them
    each keep their own chunks, and none repeats."""
    histories: dict[tuple[str, str], InMemoryChatMessageHistory] = {}
    prompts: list[list[BaseMessage]] = []

    def history(user_id: str, chat_id: str) -> InMemoryChatMessageHistory:
        return histories.setdefault((user_id, chat_id), InMemoryChatMessageHistory())

    def record(prompt: PromptValue) -> PromptValue:
        prompts.append(prompt.to_messages())
        return prompt

    keys = [
        ConfigurableFieldSpec(id=key, annotation=str, name=key, default="", is_shared=True)
        for key in ("user_id", "chat_id")
    ]
    chain = with_chunk_history(
        chunk_chat_prompt("Answer.") | RunnableLambda(record) | FakeListChatModel(responses=["a"]),
        ChunkCacheRetriever(base_retriever=WindowRetriever(), cache=ChunkCache(), dedupe="drop"),
        history,
        history_factory_config=keys,
    )
    for user, start in [("A", "0"), ("B", "3"), ("A", "2"), ("B", "4")]:
        config = RunnableConfig(configurable={"user_id": user, "chat_id": "1"})
        chain.invoke({"question": start}, config=config)
    assert facts_in(prompts[-2]) == TEXTS[:5]  # A: 0-2, then 3-4 (2 was there already)
    assert facts_in(prompts[-1]) == TEXTS[3:7]  # B: 3-5, then 6


def test_a_retriever_bound_with_config_is_kept_in_sync() -> None:
    conversation = Conversation(max_history_turns=1)
    bound = conversation.retriever.with_config(tags=["docs"])
    conversation.chain = with_chunk_history(
        chunk_chat_prompt("Answer.")
        | RunnableLambda(conversation._record)
        | FakeListChatModel(responses=["a"] * 5),
        bound,
        lambda sid: conversation.histories.setdefault(sid, InMemoryChatMessageHistory()),
        max_history_turns=1,
    )
    conversation.ask("0", "3", "0")  # the first turn is trimmed away: its facts come back
    assert facts_in(conversation.prompts[-1]) == TEXTS[:6]


def test_a_retriever_with_retries_is_kept_in_sync() -> None:
    conversation = Conversation(max_history_turns=1)
    conversation.chain = with_chunk_history(
        chunk_chat_prompt("Answer.")
        | RunnableLambda(conversation._record)
        | FakeListChatModel(responses=["a"] * 5),
        conversation.retriever.with_retry(),
        lambda sid: conversation.histories.setdefault(sid, InMemoryChatMessageHistory()),
        max_history_turns=1,
    )
    conversation.ask("0", "3", "0")
    assert facts_in(conversation.prompts[-1]) == TEXTS[:6]


def test_a_history_factory_without_arguments_works() -> None:
    history = InMemoryChatMessageHistory()
    conversation = Conversation()
    conversation.chain = with_chunk_history(
        chunk_chat_prompt("Answer.")
        | RunnableLambda(conversation._record)
        | FakeListChatModel(responses=["a"] * 5),
        conversation.retriever,
        lambda: history,
    )
    conversation.ask("0", "2")
    assert facts_in(conversation.prompts[-1]) == TEXTS[:5]


def test_a_message_the_app_edited_gives_back_the_chunks_it_lost() -> None:
    """An app that rewrites an earlier user message (keeping its ``additional_kwargs``)
    took that message's chunks out of the prompt: ``drop`` must send them again."""
    conversation = Conversation()
    conversation.ask("0")  # facts 0-2
    messages = conversation.histories["conv-1"].messages
    edited = str(messages[0].content).replace(TEXTS[1], "(removed)")
    messages[0] = messages[0].model_copy(update={"content": edited})
    conversation.ask("1")  # facts 1-3: fact 1 is no longer in the history
    assert facts_in(conversation.prompts[-1]) == TEXTS[:4]


@pytest.mark.parametrize("recorded", [None, 5, "abc", {"id": 1}, ["x", 2]])
def test_a_chunk_ids_entry_of_another_shape_records_no_chunk(recorded: object) -> None:
    """``additional_kwargs["chunk_ids"]`` set by something else (or a damaged saved
    history) neither crashes a turn nor passes its characters off as chunk ids."""
    message = HumanMessage(content="hello", additional_kwargs={"chunk_ids": recorded})
    assert chunk_ids_in([message]) == (["x"] if recorded == ["x", 2] else [])
    histories = {"conv-1": InMemoryChatMessageHistory(messages=[message, AIMessage("hi")])}
    conversation = Conversation(histories=histories)
    conversation.ask("0")
    assert facts_in(conversation.prompts[-1]) == TEXTS[:3]


def test_an_empty_session_id_is_a_clear_error() -> None:
    conversation = Conversation()
    with pytest.raises(InvalidConversationIdError):
        conversation.chain.invoke(
            {"question": "0"}, config=RunnableConfig(configurable={"session_id": ""})
        )


@pytest.mark.parametrize("session_id", ["x" * 300, "会話-😀", 42])
def test_long_unicode_and_int_session_ids_name_a_conversation(session_id: object) -> None:
    conversation = Conversation()
    config = RunnableConfig(configurable={"session_id": session_id})
    for question in ("0", "1"):
        conversation.chain.invoke({"question": question}, config=config)
    assert facts_in(conversation.prompts[-1]) == TEXTS[:4]  # fact 1-2 not sent twice

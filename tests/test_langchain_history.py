"""The multi-turn layout helper: each prompt extends the previous one, dedupe is safe."""

from __future__ import annotations

import itertools

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.chat_history import InMemoryChatMessageHistory
from langchain_core.documents import Document
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import BaseMessage
from langchain_core.prompt_values import PromptValue
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig, RunnableLambda

from chunkcache.core import ChunkCache
from chunkcache.core.ledger import DedupeMode
from chunkcache.integrations.langchain import ChunkCacheRetriever
from chunkcache.integrations.langchain_history import (
    chunk_chat_prompt,
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


def run_conversation(questions: list[str], dedupe: DedupeMode = "drop") -> list[list[BaseMessage]]:
    histories: dict[str, InMemoryChatMessageHistory] = {}
    prompts: list[list[BaseMessage]] = []

    def record(prompt: PromptValue) -> PromptValue:
        prompts.append(prompt.to_messages())
        return prompt

    retriever = ChunkCacheRetriever(
        base_retriever=WindowRetriever(),
        cache=ChunkCache(),
        dedupe=dedupe,
    )
    llm = FakeListChatModel(responses=[f"answer {i}" for i in range(len(questions))])
    chain = with_chunk_history(
        chunk_chat_prompt("Answer from the context.") | RunnableLambda(record) | llm,
        retriever,
        lambda sid: histories.setdefault(sid, InMemoryChatMessageHistory()),
    )
    config = RunnableConfig(configurable={"session_id": "conv-1"})
    for question in questions:
        chain.invoke({"question": question}, config=config)
    return prompts


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

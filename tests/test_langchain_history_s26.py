"""with_chunk_history over history keys of the app's own: the LLM in the chain names the
conversation as the retriever does, so a turn's prompt finds the past turns' KV."""

from __future__ import annotations

from typing import Any

import pytest
from fake_backend import FakeBackend
from langchain_core.runnables import ConfigurableFieldSpec, RunnableConfig
from test_langchain_history import WindowRetriever
from tiny_models import tiny_hf_model

from chunkcache.core import ChunkCache
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.model_files import pull_default_model
from chunkcache.core.models import LoadedModel
from chunkcache.integrations.langchain import ChunkCacheLLM, ChunkCacheRetriever
from chunkcache.integrations.langchain_history import (
    InMemoryChatHistory,
    chunk_chat_prompt,
    with_chunk_history,
)


@pytest.fixture(scope="module")
def tiny_smollm2() -> LoadedModel:
    """A tiny random model with SmolLM2's tokenizer and chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pull_default_model())
    return LoadedModel.from_hf(tiny_hf_model(vocab_size=len(tokenizer)), tokenizer)


def history_keys(*names: str) -> list[ConfigurableFieldSpec]:
    return [
        ConfigurableFieldSpec(id=name, annotation=str, name=name, default="", is_shared=True)
        for name in names
    ]


class Chat:
    """A chat over ``FakeBackend`` whose history is found by the ``keys`` config fields."""

    def __init__(self, *keys: str, **bound: Any) -> None:
        self.llm = ChunkCacheLLM(chunk_cache=ChunkCache(backend=FakeBackend()))
        self.retriever = ChunkCacheRetriever(
            base_retriever=WindowRetriever(), cache=self.llm.chunk_cache, dedupe="drop"
        )
        self.histories: dict[tuple[str, ...], InMemoryChatHistory] = {}
        self.chain = with_chunk_history(
            chunk_chat_prompt("Answer from the context.") | self.llm.bind(**bound),
            self.retriever,
            self._history,
            history_factory_config=history_keys(*keys),
        )

    def _history(self, *value: str, **values: str) -> InMemoryChatHistory:
        """One key's value comes positionally, several keys' by name."""
        key = (*value, *values.values())
        return self.histories.setdefault(key, InMemoryChatHistory())

    def sent_conversations(self) -> list[str | None]:
        backend = self.llm.chunk_cache.backend
        assert isinstance(backend, FakeBackend)
        return [request.conversation_id for request in backend.requests]

    def retrievers_conversations(self) -> set[str]:
        """The conversations whose ledger holds chunks: the ones the retriever named."""
        return {c for c in self.sent_conversations() if c and self.retriever.cache.ledger.seen(c)}


@pytest.mark.parametrize(
    "keys", [("user_id",), ("user_id", "chat_id"), ("user_id", "conversation_id")]
)
def test_the_llm_is_told_the_retrievers_conversation(keys: tuple[str, ...]) -> None:
    chat = Chat(*keys)
    for user, question in [("A", "0"), ("B", "0"), ("A", "3")]:
        configurable = {key: "1" for key in keys} | {"user_id": user}
        chat.chain.invoke({"question": question}, config=RunnableConfig(configurable=configurable))
    first, other_user, second = chat.sent_conversations()
    assert first is not None and first == second  # one conversation, turn after turn
    assert other_user not in (None, first)  # another user sharing the chat id is another one
    assert chat.retrievers_conversations() == {first, other_user}


@pytest.mark.parametrize("keys", [("user_id",), ("user_id", "conversation_id")])
async def test_the_llm_is_told_the_retrievers_conversation_when_streamed_async(
    keys: tuple[str, ...],
) -> None:
    chat = Chat(*keys)
    config = RunnableConfig(configurable=dict.fromkeys(keys, "1"))
    await chat.chain.ainvoke({"question": "0"}, config=config)
    _ = [chunk async for chunk in chat.chain.astream({"question": "3"}, config=config)]
    _ = list(chat.chain.stream({"question": "5"}, config=config))
    (conversation,) = set(chat.sent_conversations())
    assert chat.retrievers_conversations() == {conversation}


def test_a_conversation_id_the_app_gives_the_llm_is_kept() -> None:
    """An id bound to the LLM, or set in the config beside other history keys, is the app's
    choice for the LLM; with_chunk_history does not replace it."""
    bound = Chat("user_id", conversation_id="pinned")
    bound.chain.invoke({"question": "0"}, config=RunnableConfig(configurable={"user_id": "A"}))
    assert bound.sent_conversations() == ["pinned"]
    chat = Chat("user_id")
    configurable = {"user_id": "A", "conversation_id": "app-chosen"}
    chat.chain.invoke({"question": "0"}, config=RunnableConfig(configurable=configurable))
    assert chat.sent_conversations() == ["app-chosen"]


def test_on_the_engine_a_chat_keyed_by_user_reuses_its_past_turns_as_a_prefix(
    tiny_smollm2: LoadedModel,
) -> None:
    """The engine keeps a conversation's last sequence under the id the LLM gives it; the
    next turn's prompt starts with it, so all of it is reused."""
    cache = ChunkCache(backend=LocalBackend(ChunkEngine(tiny_smollm2)))
    llm = ChunkCacheLLM(chunk_cache=cache, max_tokens=4)
    history = InMemoryChatHistory()
    chat = with_chunk_history(
        chunk_chat_prompt("Answer from the context.") | llm,
        ChunkCacheRetriever(base_retriever=WindowRetriever(), cache=cache, dedupe="drop"),
        lambda user_id: history,
        history_factory_config=history_keys("user_id"),
    )
    config = RunnableConfig(configurable={"user_id": "A"})
    first = chat.invoke({"question": "0"}, config=config).response_metadata["chunkcache"]
    second = chat.invoke({"question": "3"}, config=config).response_metadata["chunkcache"]
    assert isinstance(cache.backend, LocalBackend)
    assert list(cache.backend.engine.remembered()) == ["A"]
    assert second["reused_tokens"] >= first["prompt_tokens"]

"""LangChain's token counting on ChunkCacheLLM counts as its backend does, offline.

``get_token_ids``/``get_num_tokens`` use the backend's tokenizer, and
``get_num_tokens_from_messages`` (what ``trim_messages(..., token_counter=llm)`` calls)
counts the prompt the model sends: chat template applied, chunks found, per segment on the
local engines.  LangChain's fallback, GPT-2's tokenizer from the Hugging Face hub, is never
asked for: every test here fails if it is.  The local backend runs the default model,
SmolLM2-135M-Instruct; the reference counts come from its tokenizer, loaded on its own.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.language_models import base as langchain_base
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.messages.utils import trim_messages
from test_vllm_backend import FakeVllm, make_backend
from transformers import AutoTokenizer

from chunkcache.core.cache import ChunkCache
from chunkcache.core.errors import UsageError
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.model_files import pull_default_model
from chunkcache.integrations.langchain import ChunkCacheLLM

CHUNK = (
    "The json module's dumps function serializes a Python object to a JSON formatted "
    "string; loads parses such a string back into Python objects."
)
ASKED = [
    SystemMessage("Answer from the context."),
    HumanMessage(f"Context: {CHUNK}\nWhat does dumps return?"),
]
NUMBERS = "Order 12345 left Zürich on 2024-05-17 with 88 crates."
NO_SERVER = "http://127.0.0.1:9"  # never contacted: nothing is counted on http


@pytest.fixture(autouse=True)
def no_gpt2(monkeypatch: pytest.MonkeyPatch) -> None:
    """LangChain's fallback tokenizer (GPT-2, downloaded from the hub) fails any test that
    asks for it."""

    def refused() -> None:
        raise AssertionError("LangChain's fallback GPT-2 tokenizer was asked for")

    monkeypatch.setattr(langchain_base, "get_tokenizer", refused)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """SmolLM2's own tokenizer, loaded apart from any backend: the reference counts."""
    return AutoTokenizer.from_pretrained(pull_default_model())


@pytest.fixture(scope="module")
def smollm2() -> LocalBackend:
    return LocalBackend.default()


@pytest.fixture
def llm(smollm2: LocalBackend) -> ChunkCacheLLM:
    return ChunkCacheLLM(chunk_cache=ChunkCache(backend=smollm2), max_tokens=1)


def ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def rendered(tokenizer: Any, messages: list[BaseMessage]) -> str:
    """The prompt SmolLM2's chat template makes of ``messages``."""
    roles = {"system": "system", "human": "user", "ai": "assistant"}
    chat = [{"role": roles[m.type], "content": m.content} for m in messages]
    return str(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def per_segment_count(tokenizer: Any, prompt: str) -> int:
    """``prompt``'s tokens as the local engines count them with CHUNK found in it: the text
    before, the chunk and the text after, each tokenized on its own."""
    before, after = prompt.split(CHUNK)
    return len(ids(tokenizer, before)) + len(ids(tokenizer, CHUNK)) + len(ids(tokenizer, after))


def test_text_is_counted_with_the_models_tokenizer(llm: ChunkCacheLLM, tokenizer: Any) -> None:
    expected = ids(tokenizer, NUMBERS)
    assert llm.get_token_ids(NUMBERS) == expected
    assert llm.get_num_tokens(NUMBERS) == len(expected)


def test_messages_count_as_the_prompt_the_chat_template_makes(
    llm: ChunkCacheLLM, tokenizer: Any
) -> None:
    chat: list[BaseMessage] = [
        SystemMessage("Be brief."),
        HumanMessage("What is 12 + 30?"),
        AIMessage("42."),
        HumanMessage(NUMBERS),
    ]
    alone: list[BaseMessage] = [HumanMessage("Hi")]  # the template adds a system prompt
    for messages in (chat, alone):
        expected = len(ids(tokenizer, rendered(tokenizer, messages)))
        assert llm.get_num_tokens_from_messages(messages) == expected


def test_chunks_count_per_segment_as_the_engine_counts_them(
    llm: ChunkCacheLLM, tokenizer: Any
) -> None:
    prompt = rendered(tokenizer, ASKED)
    whole = len(ids(tokenizer, prompt))
    per_segment = per_segment_count(tokenizer, prompt)
    assert per_segment != whole  # " The" is one token in the whole prompt, two when split
    assert llm.get_num_tokens_from_messages(ASKED) == whole  # no chunk known yet
    assert llm.get_num_tokens_from_messages(ASKED, chunks=[("json-doc", CHUNK)]) == per_segment
    llm.chunk_cache.registry.register("json-doc", CHUNK)  # as a retriever would
    assert llm.get_num_tokens_from_messages(ASKED) == per_segment
    answer = llm.invoke(ASKED)
    assert answer.usage_metadata is not None
    assert answer.usage_metadata["input_tokens"] == per_segment


def test_trim_messages_counts_with_the_model_offline(llm: ChunkCacheLLM) -> None:
    turns: list[BaseMessage] = []
    for i in range(8):
        turns += [HumanMessage(f"What arrived in shipment {i}?"), AIMessage(f"{i * 37} crates.")]
    history = [SystemMessage("Answer from the log."), *turns, HumanMessage(NUMBERS)]
    budget = llm.get_num_tokens_from_messages(history) - 40
    trimmed = trim_messages(
        history, max_tokens=budget, token_counter=llm, strategy="last", include_system=True
    )
    kept = len(trimmed) - 1
    assert trimmed[0] is history[0] and trimmed[1:] == history[-kept:]
    assert 1 <= kept < len(history) - 1
    # trim_messages counts the system message apart from the rest, so the template's
    # framing is counted twice: the prompt kept is within the budget, not always at it.
    assert llm.get_num_tokens_from_messages(trimmed) <= budget


def test_on_http_counting_is_refused_with_what_to_do() -> None:
    llm = ChunkCacheLLM(chunk_cache=ChunkCache(backend="http", base_url=NO_SERVER))
    expected = r"no tokenizer in this process.*custom_get_token_ids.*backend='local' or 'vllm'"
    with pytest.raises(UsageError, match=expected):
        llm.get_num_tokens(NUMBERS)
    with pytest.raises(UsageError, match=expected):
        llm.get_num_tokens_from_messages(ASKED)
    with pytest.raises(UsageError, match=expected):
        trim_messages(ASKED, max_tokens=10, token_counter=llm)


def test_custom_get_token_ids_is_used_as_langchain_uses_it() -> None:
    cache = ChunkCache()  # the local backend: never built to count here

    def word_lengths(text: str) -> list[int]:
        return [len(word) for word in text.split()]

    llm = ChunkCacheLLM(chunk_cache=cache, custom_get_token_ids=word_lengths)
    assert llm.get_token_ids("a bb") == [1, 2]
    assert llm.get_num_tokens("a bb ccc") == 3
    assert llm.get_num_tokens_from_messages([HumanMessage("a bb")]) == 3  # "Human: a bb"
    assert cache._backend is None  # no model was loaded
    on_http = ChunkCache(backend="http", base_url=NO_SERVER)
    llm = ChunkCacheLLM(chunk_cache=on_http, custom_get_token_ids=word_lengths)
    words = sum(len(str(m.content).split()) + 1 for m in ASKED)  # "System: ...", "Human: ..."
    assert llm.get_num_tokens_from_messages(ASKED) == words


def test_tools_are_refused_as_the_model_has_no_tool_calling(llm: ChunkCacheLLM) -> None:
    tool = {"type": "function", "function": {"name": "add", "parameters": {}}}
    with pytest.raises(TypeError, match="no tool calling"):
        llm.get_num_tokens_from_messages(ASKED, tools=[tool])
    assert llm.get_num_tokens_from_messages(ASKED, tools=[]) == llm.get_num_tokens_from_messages(
        ASKED
    )
    with pytest.raises(TypeError, match="unsupported arguments"):
        llm.get_num_tokens_from_messages(ASKED, tool_choice="add")


def test_on_vllm_the_whole_prompt_is_counted_with_its_tokenizer(tokenizer: Any) -> None:
    """vLLM tokenizes the prompt it is sent as one text; nothing reaches the server."""
    vllm = FakeVllm()
    llm = ChunkCacheLLM(chunk_cache=ChunkCache(backend=make_backend(vllm, tokenizer=tokenizer)))
    llm.chunk_cache.registry.register("json-doc", CHUNK)
    assert llm.get_token_ids(NUMBERS) == ids(tokenizer, NUMBERS)
    prompt = rendered(tokenizer, ASKED)
    assert llm.get_num_tokens_from_messages(ASKED) == len(ids(tokenizer, prompt))
    assert vllm.requests == []

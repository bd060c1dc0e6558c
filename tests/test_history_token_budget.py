"""The chat helpers keep a long conversation inside the context window: with no
``max_history_turns``, a prompt that would not fit (with the answer's ``max_tokens``) loses
the older half of its turns, again until it fits, so the cached prefix breaks once every
few turns; a prompt that cannot fit even alone is refused and the history stays.

The fast tests run a tiny random model under SmolLM2's real tokenizer and chat template
with a 1k window (the counting needs nothing else); the slow ones run SmolLM2 itself, its
window cut to the same 1k (filling its 8k window would take minutes)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_support import RecordingEngine
from fake_backend import RenderCountingBackend
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import HumanMessage
from langchain_core.retrievers import BaseRetriever as LangChainBaseRetriever
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda
from llama_index.core.retrievers import BaseRetriever as LlamaIndexBaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from test_vllm_backend import FakeVllm, make_backend
from tiny_models import tiny_hf_model

from chunkcache.core.cache import ChunkCache
from chunkcache.core.errors import PromptTooLongError
from chunkcache.core.generation import Backend, GenerationRequest
from chunkcache.core.local_backend import LocalBackend, LocalStream
from chunkcache.core.model_files import pull_default_model
from chunkcache.core.models import LoadedModel
from chunkcache.integrations import langchain, llama_index
from chunkcache.integrations.langchain_chat_turns import InMemoryChatHistory, prompt_budget
from chunkcache.integrations.langchain_history import chunk_chat_prompt, with_chunk_history
from chunkcache.integrations.llama_index_chat import CHAT_FIT_HINT, ChunkCacheChatEngine
from chunkcache.integrations.llama_index_tokens import COUNTING_HINT

WINDOW = 1024
MAX_TOKENS = 8
TURNS = 16
SYSTEM = "Answer from the context."
CONFIG = RunnableConfig(configurable={"session_id": "long-chat"})
USER = "<|im_start|>user"
ANCHOR = "Depot log 0: the ledger opens here, kept by inspector Ada at gate 9."
HUGE = " ".join(f"Line {i}: crate 4{i}1 weighs 7{i}3 kg." for i in range(120))
CITIES = ("Oslo", "Lima", "Pune", "Graz", "Kobe", "Turku", "Cusco", "Nantes")


def record(i: int) -> str:
    """A depot record of about 60 tokens (SmolLM2 splits numbers into digits)."""
    city = CITIES[i % len(CITIES)]
    return (
        f"Depot log {i + 1}: the {city} depot received {i * 37 + 11} crates of part "
        f"{i * 53 + 7} on 2024-{i % 12 + 1:02d}-{i % 28 + 1:02d}; batch {i * 91 + 3} was "
        f"signed by inspector {city[::-1]} at gate {i % 9}."
    )


def texts_for(question: str) -> list[str]:
    """What a question retrieves: the anchor (retrieved every turn), then two new records;
    the question ``huge`` retrieves a text longer than the window."""
    if question == "huge":
        return [HUGE]
    i = int(re.findall(r"\d+", question)[-1])
    return [ANCHOR, record(2 * i), record(2 * i + 1)]


def question(i: int) -> str:
    return f"What arrived in shipment {i}?"


class LangChainRecords(LangChainBaseRetriever):
    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return [Document(page_content=text) for text in texts_for(query)]


class LlamaIndexRecords(LlamaIndexBaseRetriever):
    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        texts = texts_for(query_bundle.query_str)
        return [NodeWithScore(node=TextNode(text=text), score=1.0) for text in texts]


class RecordingBackend(LocalBackend):
    """The local backend, keeping every prompt it is sent (refused ones too)."""

    def __init__(self, engine: RecordingEngine) -> None:
        super().__init__(engine)
        self.recording = engine
        self.prompts: list[str] = []

    def stream(self, request: GenerationRequest) -> LocalStream:
        self.prompts.append("".join(segment.text for segment in request.segments))
        return super().stream(request)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: on a loaded 2-core machine two spin against each other, and the
    tiny model's decode steps took 0.1 s instead of a few ms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_smollm2() -> LoadedModel:
    """A tiny random model with SmolLM2's tokenizer (and chat template) and a 1k window."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pull_default_model())
    hf = tiny_hf_model(vocab_size=len(tokenizer), max_position_embeddings=WINDOW)
    return LoadedModel.from_hf(hf, tokenizer)


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    """SmolLM2 itself, its window cut to ``WINDOW``."""
    lm = LocalBackend.default().engine.lm
    spec = dataclasses.replace(lm.spec, max_positions=WINDOW)
    return LoadedModel(lm.hf, lm.tokenizer, spec, lm.rope, lm.fingerprint)


def recording_cache(lm: LoadedModel) -> tuple[ChunkCache, RecordingBackend]:
    backend = RecordingBackend(RecordingEngine(lm))
    return ChunkCache(backend=backend), backend


def langchain_chat(
    cache: ChunkCache, chain: Runnable[Any, Any] | None = None
) -> tuple[Runnable[dict[str, Any], Any], InMemoryChatHistory]:
    history = InMemoryChatHistory()
    llm = langchain.ChunkCacheLLM(chunk_cache=cache, max_tokens=MAX_TOKENS)
    chat = with_chunk_history(
        chain or chunk_chat_prompt(SYSTEM) | llm,
        langchain.ChunkCacheRetriever(
            base_retriever=LangChainRecords(), cache=cache, dedupe="drop"
        ),
        lambda session_id: history,
    )
    return chat, history


def llama_index_chat(cache: ChunkCache) -> ChunkCacheChatEngine:
    return ChunkCacheChatEngine.from_defaults(
        LlamaIndexRecords(),
        llama_index.ChunkCacheLLM(cache=cache, max_tokens=MAX_TOKENS),
        system_prompt=SYSTEM,
        cache=cache,
        conversation_id="long-chat",
    )


def assert_kept_inside_the_window(backend: RecordingBackend, turns: int = TURNS) -> None:
    """Every turn was answered inside the window; the history lost its older half only when
    the prompt would not have fitted, so each other prompt extends the one before; no chunk
    was lost to dedupe (the anchor, retrieved every turn, is in every prompt once)."""
    prompts = backend.prompts
    assert len(prompts) == turns
    assert all(call.tokens + call.reserve <= WINDOW for call in backend.recording.calls)
    assert max(call.tokens for call in backend.recording.calls) > WINDOW - MAX_TOKENS - 200
    users = [prompt.count(USER) for prompt in prompts]
    breaks = [t for t in range(1, turns) if not prompts[t].startswith(prompts[t - 1])]
    assert len(breaks) >= 2  # the window was reached more than once
    for t in range(1, turns):
        held = users[t - 1]  # the turns the history holds once turn t - 1 is saved
        assert users[t] - 1 == (held // 2 if t in breaks else held)
    assert all(prompt.count(ANCHOR) == 1 for prompt in prompts)


def test_a_langchain_chat_longer_than_the_window_goes_on(tiny_smollm2: LoadedModel) -> None:
    cache, backend = recording_cache(tiny_smollm2)
    chat, history = langchain_chat(cache)
    for i in range(TURNS):
        chat.invoke({"question": question(i)}, config=CONFIG)
    assert_kept_inside_the_window(backend)
    assert sum(isinstance(m, HumanMessage) for m in history.messages) < TURNS


async def test_async_langchain_turns_keep_the_window_too(tiny_smollm2: LoadedModel) -> None:
    cache, backend = recording_cache(tiny_smollm2)
    chat, _ = langchain_chat(cache)
    for i in range(TURNS):
        if i % 2:
            await chat.ainvoke({"question": question(i)}, config=CONFIG)
        else:
            [_ async for _ in chat.astream({"question": question(i)}, config=CONFIG)]
    assert_kept_inside_the_window(backend)


def test_a_llama_index_chat_longer_than_the_window_goes_on(tiny_smollm2: LoadedModel) -> None:
    cache, backend = recording_cache(tiny_smollm2)
    engine = llama_index_chat(cache)
    for i in range(TURNS):
        if i % 2:
            engine.chat(question(i))
        else:
            for _ in engine.stream_chat(question(i)).response_gen:
                pass
    assert_kept_inside_the_window(backend)
    assert len(engine.chat_history) < 2 * TURNS


async def test_async_llama_index_turns_keep_the_window_too(tiny_smollm2: LoadedModel) -> None:
    cache, backend = recording_cache(tiny_smollm2)
    engine = llama_index_chat(cache)
    for i in range(TURNS):
        if i % 2:
            await engine.achat(question(i))
        else:
            async for _ in (await engine.astream_chat(question(i))).async_response_gen():
                pass
    assert_kept_inside_the_window(backend)


def test_a_langchain_turn_too_long_alone_is_refused_and_changes_nothing(
    tiny_smollm2: LoadedModel,
) -> None:
    cache, backend = recording_cache(tiny_smollm2)
    chat, history = langchain_chat(cache)
    for i in range(3):
        chat.invoke({"question": question(i)}, config=CONFIG)
    saved = list(history.messages)
    seen = cache.ledger.seen("long-chat")
    with pytest.raises(PromptTooLongError, match="context window"):
        chat.invoke({"question": "huge"}, config=CONFIG)
    assert backend.prompts[-1].count(USER) == 1  # sent with no history, as small as it gets
    assert history.messages == saved and cache.ledger.seen("long-chat") == seen
    chat.invoke({"question": question(3)}, config=CONFIG)
    assert backend.prompts[-1].startswith(backend.prompts[-3])  # the cached prefix holds


def test_a_llama_index_turn_too_long_alone_is_refused_and_changes_nothing(
    tiny_smollm2: LoadedModel,
) -> None:
    cache, backend = recording_cache(tiny_smollm2)
    engine = llama_index_chat(cache)
    for i in range(3):
        engine.chat(question(i))
    saved = engine.chat_history
    seen = cache.ledger.seen("long-chat")
    with pytest.raises(PromptTooLongError, match="context window") as refused:
        engine.chat("huge")
    # a chat's fixes, not the query engines' advice on how LlamaIndex counts tokens
    assert str(refused.value).endswith(CHAT_FIT_HINT) and COUNTING_HINT not in str(refused.value)
    assert backend.prompts[-1].count(USER) == 1
    assert engine.chat_history == saved and cache.ledger.seen("long-chat") == seen
    engine.chat(question(3))
    assert backend.prompts[-1].startswith(backend.prompts[-3])


def test_the_budget_is_read_from_a_prompt_then_a_chunkcache_llm_only() -> None:
    cache = ChunkCache()  # its backend (a model) is never built: nothing is counted here
    llm = langchain.ChunkCacheLLM(chunk_cache=cache, max_tokens=MAX_TOKENS)
    prompt = chunk_chat_prompt(SYSTEM)
    bound = prompt_budget((prompt | llm.bind(max_tokens=5)).with_config(run_name="chat"))
    assert bound is not None and bound.llm is llm and bound.options == {"max_tokens": 5}
    assert prompt_budget(prompt | llm.with_retry() | RunnableLambda(str)) is not None
    not_ours = FakeListChatModel(responses=["a"])
    assert prompt_budget(prompt | not_ours) is None
    assert prompt_budget(prompt | RunnableLambda(lambda p: p) | llm) is None
    assert prompt_budget(llm) is None


def test_a_chat_on_another_llm_is_not_counted_or_trimmed() -> None:
    cache = ChunkCache()
    fake = FakeListChatModel(responses=[f"answer {i}" for i in range(TURNS)])
    chat, history = langchain_chat(cache, chunk_chat_prompt(SYSTEM) | fake)
    for i in range(TURNS):
        chat.invoke({"question": question(i)}, config=CONFIG)
    assert len(history.messages) == 2 * TURNS
    assert cache._backend is None  # no model was loaded to count


def ask_both(backend: Backend, turns: int) -> None:
    """``turns`` turns of a LangChain chat and of a LlamaIndex chat on ``backend``."""
    chat, _ = langchain_chat(ChunkCache(backend=backend))
    engine = llama_index_chat(ChunkCache(backend=backend))
    for i in range(turns):
        chat.invoke({"question": question(i)}, config=CONFIG)
        engine.chat(question(i))


def test_on_a_backend_without_a_tokenizer_here_nothing_is_rendered_to_count() -> None:
    backend = RenderCountingBackend()
    ask_both(backend, 3)
    assert backend.renders == 6  # the prompts sent, no more (on http each is a request)


def test_on_vllm_prompts_are_counted_as_its_backend_counts_them() -> None:
    """The vLLM backend refuses a prompt over the window itself, counting the whole prompt
    with its tokenizer (here: one token per word)."""
    vllm = FakeVllm()
    ask_both(make_backend(vllm, window=400), TURNS)
    bodies = [vllm.body(i) for i in range(2 * TURNS)]
    assert all(len(b["prompt"].split()) + b["max_tokens"] <= 400 for b in bodies)
    assert min(b["prompt"].count(USER) for b in bodies[TURNS:]) < TURNS // 2  # trimmed


@pytest.mark.slow
def test_on_smollm2_a_langchain_chat_longer_than_the_window_goes_on(
    smollm2: LoadedModel,
) -> None:
    cache, backend = recording_cache(smollm2)
    chat, _ = langchain_chat(cache)
    answers = [chat.invoke({"question": question(i)}, config=CONFIG) for i in range(TURNS)]
    assert_kept_inside_the_window(backend)
    assert all(str(answer.content).strip() for answer in answers)


@pytest.mark.slow
def test_on_smollm2_a_llama_index_chat_longer_than_the_window_goes_on(
    smollm2: LoadedModel,
) -> None:
    cache, backend = recording_cache(smollm2)
    engine = llama_index_chat(cache)
    answers = [engine.chat(question(i)).response for i in range(TURNS)]
    assert_kept_inside_the_window(backend)
    assert all(answer.strip() for answer in answers)

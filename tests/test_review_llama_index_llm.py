"""LlamaIndex ChunkCacheLLM reviewed on the local backend (tiny random model): every entry
point, streams against non-streams, stats, the event loop, cancellation, messages, per-call
options, metadata, a real query engine, and the chat engine's conversation."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from fake_backend import FakeBackend
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    MessageRole,
    TextBlock,
)
from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.prompts import PromptTemplate
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from tiny_models import tiny_hf_model, tiny_lm, tiny_tokenizer

from chunkcache.core.cache import ChunkCache
from chunkcache.core.engine import ChunkEngine, Prefilled
from chunkcache.core.generation import SamplingParams
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.segmenter import ChunkSegment
from chunkcache.integrations.embeddings import MiniLMEmbedding
from chunkcache.integrations.llama_index import (
    ChunkCacheLLM,
    ChunkCachePostprocessor,
    ChunkCacheRetriever,
)
from chunkcache.integrations.llama_index_chat import ChunkCacheChatEngine
from chunkcache.integrations.llama_index_llm import ChunkLike

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
CHUNK = " ".join(f"w{i}" for i in range(10, 40))
PROMPT = f"w1 w2 w3 {CHUNK} w4 w5"
CHUNKS: list[ChunkLike] = [("chunk-a", CHUNK)]
COMPLETIONS = ("complete", "stream_complete", "acomplete", "astream_complete")
CHATS = ("chat", "stream_chat", "achat", "astream_chat")
Response = CompletionResponse | ChatResponse


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


class PausingEngine(ChunkEngine):
    """Decoding pauses before its second token until ``gate`` is set (``paused`` says it
    got there); ``closed`` is set when a decode ends, finished or closed early."""

    def __init__(self, lm: LoadedModel) -> None:
        super().__init__(lm)
        self.gate = threading.Event()
        self.paused = threading.Event()
        self.closed = threading.Event()
        self.decoded = 0

    def decode(self, prefilled: Prefilled, params: SamplingParams) -> Iterator[int]:
        try:
            for i, token in enumerate(super().decode(prefilled, params)):
                if i == 1:
                    self.paused.set()
                    assert self.gate.wait(timeout=30)
                self.decoded += 1
                yield token
        finally:
            self.closed.set()


def local_llm(
    lm: LoadedModel, template: str | None = TEMPLATE, engine: type = ChunkEngine, **settings: Any
) -> ChunkCacheLLM:
    """An LLM on a fresh local backend over ``lm``, its tokenizer's chat template ``template``."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = template
    model = LoadedModel(lm.hf, tokenizer, lm.spec, lm.rope, lm.fingerprint)
    return ChunkCacheLLM(cache=ChunkCache(backend=LocalBackend(engine(model))), **settings)


def engine_of(llm: ChunkCacheLLM) -> Any:
    backend = llm.cache.backend
    assert isinstance(backend, LocalBackend)
    return backend.engine


def call(llm: ChunkCacheLLM, method: str, prompt: str = PROMPT, **kwargs: Any) -> list[Response]:
    """Every response ``method`` gives for ``prompt`` (as a user message for chat methods)."""
    arg: Any = (
        prompt if method in COMPLETIONS else [ChatMessage(role=MessageRole.USER, content=prompt)]
    )
    if not method.startswith("a"):
        result = getattr(llm, method)(arg, **kwargs)
        return list(result) if method.startswith("stream") else [result]

    async def run() -> list[Response]:
        result = await getattr(llm, method)(arg, **kwargs)
        return [r async for r in result] if method.startswith("astream") else [result]

    return asyncio.run(run())


def text_of(response: Response) -> str:
    if isinstance(response, ChatResponse):
        return response.message.content or ""
    return response.text


def checked_stats(responses: list[Response]) -> dict[str, Any]:
    """The last response's stats, checked for presence and consistency."""
    *head, last = responses
    assert all("chunkcache" not in r.additional_kwargs and not r.raw for r in head)
    stats: dict[str, Any] = last.additional_kwargs["chunkcache"]
    assert last.raw is not None and last.raw["chunkcache"] == stats
    assert last.raw["usage"] == {
        "prompt_tokens": stats["prompt_tokens"],
        "completion_tokens": stats["completion_tokens"],
        "total_tokens": stats["prompt_tokens"] + stats["completion_tokens"],
    }
    parts = stats["reused_tokens"] + stats["recomputed_tokens"] + stats["computed_tokens"]
    assert parts == stats["prompt_tokens"] > 0
    assert stats["completion_tokens"] > 0 and stats["ttft_s"] > 0
    return stats


@pytest.mark.parametrize("methods", [COMPLETIONS, CHATS], ids=["complete", "chat"])
def test_every_entry_point_gives_the_same_greedy_text_and_full_stats(
    lm: LoadedModel, methods: tuple[str, ...]
) -> None:
    llm = local_llm(lm, max_tokens=8, recompute="full")
    texts = []
    for method in methods:
        responses = call(llm, method)
        checked_stats(responses)
        texts.append(text_of(responses[-1]))
        if "stream" in method:
            assert "".join(r.delta or "" for r in responses) == texts[-1]
    assert texts[0] and texts == [texts[0]] * len(methods)


@pytest.mark.parametrize("method", COMPLETIONS + CHATS)
def test_every_entry_point_reuses_a_chunk(lm: LoadedModel, method: str) -> None:
    llm = local_llm(lm, max_tokens=4)
    first = checked_stats(call(llm, "complete", chunks=CHUNKS))
    again = checked_stats(call(llm, method, chunks=CHUNKS))
    assert (first["chunk_hits"], first["chunk_misses"]) == (0, 1)
    assert (again["chunk_hits"], again["chunk_misses"]) == (1, 0)
    assert again["reused_tokens"] > 0


@pytest.mark.parametrize("method", ["astream_complete", "astream_chat"])
def test_an_async_stream_leaves_the_event_loop_free_while_it_decodes(
    lm: LoadedModel, method: str
) -> None:
    llm = local_llm(lm, engine=PausingEngine, max_tokens=8, recompute="full")
    engine = engine_of(llm)
    engine.gate.set()
    expected = text_of(call(llm, method)[-1])
    engine.gate.clear()
    engine.paused.clear()

    async def scenario() -> str:
        arg: Any = PROMPT if method == "astream_complete" else [ChatMessage(content=PROMPT)]
        stream = await getattr(llm, method)(arg)
        consumer = asyncio.ensure_future(_join(stream))
        # The engine waits for this coroutine to open the gate: a stream that held the
        # event loop while it decodes would never let it run (and the engine's wait fails).
        assert await asyncio.to_thread(engine.paused.wait, 30)
        assert not consumer.done()
        engine.gate.set()
        return await consumer

    assert asyncio.run(scenario()) == expected


async def _join(stream: Any) -> str:
    text = ""
    async for response in stream:
        text += response.delta or ""
    return text


@pytest.mark.parametrize("method", ["astream_complete", "astream_chat"])
def test_cancelling_an_async_stream_midway_frees_the_request(lm: LoadedModel, method: str) -> None:
    llm = local_llm(lm, engine=PausingEngine, max_tokens=8, recompute="full")
    engine = engine_of(llm)

    async def scenario() -> CompletionResponse:
        arg: Any = PROMPT if method == "astream_complete" else [ChatMessage(content=PROMPT)]
        consumer = asyncio.ensure_future(_join(await getattr(llm, method)(arg)))
        assert await asyncio.to_thread(engine.paused.wait, 30)  # mid-answer
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        engine.gate.set()
        assert await asyncio.to_thread(engine.closed.wait, 30)  # its decoding was closed...
        assert engine.decoded == 2  # ...after the step in flight
        return await llm.acomplete(PROMPT)  # and the engine serves the next request

    assert checked_stats([asyncio.run(scenario())])


def test_breaking_out_of_a_stream_frees_the_request(lm: LoadedModel) -> None:
    llm = local_llm(lm, engine=PausingEngine, max_tokens=8, recompute="full")
    engine = engine_of(llm)
    engine.gate.set()
    for _ in llm.stream_chat([ChatMessage(content=PROMPT)]):
        break
    assert engine.closed.is_set() and engine.decoded < 8


def test_message_shapes_on_the_local_backend(lm: LoadedModel) -> None:
    """System only, several system messages, empty content, text blocks: all answered."""
    llm = local_llm(lm, max_tokens=2)
    conversations = [
        [ChatMessage(role=MessageRole.SYSTEM, content="w1 w2")],
        [
            ChatMessage(role=MessageRole.SYSTEM, content="w1"),
            ChatMessage(role=MessageRole.SYSTEM, content="w2"),
        ],
        [ChatMessage(role=MessageRole.USER, content="")],
        [ChatMessage(role=MessageRole.USER, blocks=[TextBlock(text="w1"), TextBlock(text="w2")])],
    ]
    for messages in conversations:
        assert checked_stats([llm.chat(messages)])
    backend = FakeBackend()
    fake = ChunkCacheLLM(cache=ChunkCache(backend=backend))
    fake.chat(
        [ChatMessage(role=MessageRole.USER, blocks=[TextBlock(text="a"), TextBlock(text="b")])]
    )
    sent = "".join(segment.text for segment in backend.requests[-1].segments)
    assert sent == backend.render_chat([{"role": "user", "content": "a\nb"}])


@pytest.mark.parametrize(
    "message",
    [
        ChatMessage(role=MessageRole.FUNCTION, content="42"),
        ChatMessage(
            role=MessageRole.ASSISTANT,
            content="",
            additional_kwargs={"tool_calls": [{"id": "1", "function": {"name": "f"}}]},
        ),
    ],
    ids=["function", "assistant-tool-calls"],
)
def test_tool_messages_are_refused(message: ChatMessage) -> None:
    backend = FakeBackend()
    llm = ChunkCacheLLM(cache=ChunkCache(backend=backend))
    with pytest.raises(ValueError, match="no tool calling"):
        llm.chat([ChatMessage(role=MessageRole.USER, content="hi"), message])
    assert backend.requests == []


def test_per_call_options_override_the_instance(lm: LoadedModel) -> None:
    backend = FakeBackend()
    llm = ChunkCacheLLM(cache=ChunkCache(backend=backend), max_tokens=5, temperature=0.5, seed=3)
    llm.complete("hi")
    llm.chat([ChatMessage(content="hi")], max_tokens=2, temperature=0.0, top_p=0.5, seed=None)
    first, second = (r.sampling for r in backend.requests)
    assert (first.max_tokens, first.temperature, first.top_p, first.seed) == (5, 0.5, 1.0, 3)
    assert (second.max_tokens, second.temperature, second.top_p, second.seed) == (2, 0, 0.5, None)
    local = local_llm(lm, max_tokens=8)
    assert checked_stats([local.complete(PROMPT, max_tokens=1)])["completion_tokens"] == 1
    with pytest.raises(TypeError, match="unsupported arguments \\['response_format'\\]"):
        local.chat([ChatMessage(content="hi")], response_format={})


def test_stop_none_means_no_stop_strings_as_in_langchain() -> None:
    backend = FakeBackend()
    ChunkCacheLLM(cache=ChunkCache(backend=backend), stop=None).complete("hi")
    assert backend.requests[-1].sampling.stop == ()


def test_metadata_describes_the_local_model(lm: LoadedModel) -> None:
    metadata = local_llm(lm, max_tokens=7).metadata
    assert (metadata.context_window, metadata.num_output) == (lm.spec.context_window, 7)
    assert (metadata.is_chat_model, metadata.model_name) == (True, "chunkcache-local")
    assert ChunkCacheLLM(cache=ChunkCache(backend=FakeBackend())).metadata.is_chat_model


def test_a_model_without_a_chat_template_is_sent_completions(lm: LoadedModel) -> None:
    """A base model has no chat template: LlamaIndex must call complete(), and chat()
    renders with ``messages_to_prompt``, as for LlamaIndex's other completion models."""
    llm = local_llm(lm, template=None, max_tokens=4, messages_to_prompt=_as_words)
    assert not llm.metadata.is_chat_model
    assert llm.predict(PromptTemplate("w6 {question}"), question="w7 w8")
    chat = llm.chat([ChatMessage(content="w7 w8"), ChatMessage(content="w9")])
    assert checked_stats([chat])["prompt_tokens"] == len(["w7", "w8", "w9", "w100"])


def test_a_messages_to_prompt_the_app_sets_wins_over_the_chat_template(lm: LoadedModel) -> None:
    """As in LlamaIndex's HuggingFaceLLM and LlamaCPP: the app's own rendering is used."""
    llm = local_llm(lm, max_tokens=4, messages_to_prompt=_as_words)
    assert llm.metadata.is_chat_model
    chat = llm.chat([ChatMessage(content="w7 w8"), ChatMessage(content="w9")])
    assert checked_stats([chat])["prompt_tokens"] == len(["w7", "w8", "w9", "w100"])


def _as_words(messages: Sequence[ChatMessage]) -> str:
    return " ".join([*(m.content or "" for m in messages), "w100"])


class _ChatEnds(BaseEventHandler):
    """Keeps the response of every LLM chat call (a query engine replaces an LLM's own
    callback manager, so its instrumentation events are what reach the test)."""

    responses: list[Any] = Field(default_factory=list)

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent):
            self.responses.append(event.response)


def test_in_a_query_engine_the_second_query_reuses_the_chunks() -> None:
    # LlamaIndex keeps 500 tokens of padding in the window: more room than the usual tiny model
    wide = LoadedModel.from_hf(tiny_hf_model(max_position_embeddings=2048), tiny_tokenizer())
    llm = local_llm(wide, max_tokens=4)
    texts = [" ".join(f"w{(7 * d + 3 * i) % 120}" for i in range(24)) for d in range(4)]
    index = VectorStoreIndex.from_documents(
        [Document(text=text) for text in texts], embed_model=MiniLMEmbedding()
    )
    engine = index.as_query_engine(
        llm=llm,
        similarity_top_k=2,
        node_postprocessors=[ChunkCachePostprocessor(cache=llm.cache)],
    )
    chat_ends = _ChatEnds()
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(chat_ends)
    try:
        answers = [engine.query(texts[1][:30]) for _ in range(2)]
    finally:
        dispatcher.event_handlers.remove(chat_ends)
    assert all(len(answer.source_nodes) == 2 for answer in answers)
    first, second = (r.additional_kwargs["chunkcache"] for r in chat_ends.responses)
    assert (first["chunk_hits"], first["chunk_misses"]) == (0, 2)
    assert (second["chunk_hits"], second["chunk_misses"]) == (2, 0)


def test_the_chat_engine_binds_its_conversation_to_the_llm() -> None:
    """Unbound, the LLM would not keep the conversation's KV: no prefix reuse next turn."""
    backend = FakeBackend()
    llm = ChunkCacheLLM(cache=ChunkCache(backend=backend))
    engine = ChunkCacheChatEngine.from_defaults(_NoNodes(), llm, conversation_id="conv-9")
    engine.chat("first")
    asyncio.run(engine.achat("second"))
    assert [r.conversation_id for r in backend.requests] == ["conv-9", "conv-9"]
    assert llm.conversation_id is None  # the caller's LLM is left as it was
    with pytest.raises(ValueError, match="bound to conversation 'other'"):
        ChunkCacheChatEngine.from_defaults(
            _NoNodes(), llm.for_conversation("other"), conversation_id="conv-9"
        )


def test_the_chat_engine_retrieves_into_the_llms_cache() -> None:
    """An LLM on its own cache (another backend) finds the chunks the engine retrieved."""
    backend = FakeBackend()
    llm = ChunkCacheLLM(cache=ChunkCache(backend=backend))
    engine = ChunkCacheChatEngine.from_defaults(_Nodes(), llm)
    engine.chat("question")
    chunks = [s.text for s in backend.requests[-1].segments if isinstance(s, ChunkSegment)]
    assert chunks == [CHUNK]


def test_a_chat_engine_whose_llm_and_retriever_caches_differ_is_refused() -> None:
    """The LLM looks for chunks in its own cache: on another one it would find none."""
    llm = ChunkCacheLLM(cache=ChunkCache(backend=FakeBackend()))
    retriever = ChunkCacheRetriever(_Nodes(), cache=ChunkCache()).for_conversation("c1")
    with pytest.raises(ValueError, match="different ChunkCaches"):
        ChunkCacheChatEngine(retriever, llm)


class _NoNodes(BaseRetriever):
    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return []


class _Nodes(BaseRetriever):
    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [NodeWithScore(node=TextNode(text=CHUNK), score=1.0)]

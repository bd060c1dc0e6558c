"""LlamaIndex ChunkCacheLLM on the fake backend: chunks, stats, streaming, async, chat engine."""

from __future__ import annotations

from typing import Any

import pytest
from fake_backend import FakeBackend, GatedBackend
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock
from llama_index.core.callbacks.token_counting import get_tokens_from_response
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from pydantic import ValidationError

from chunkcache.core import ChunkCache, InvalidConversationIdError, chunk_id, default_cache
from chunkcache.core.chunk_ids import chunk_id_for
from chunkcache.core.generation import GenerationRequest
from chunkcache.core.segmenter import ChunkSegment
from chunkcache.integrations.llama_index import ChunkCacheLLM, ChunkCacheRetriever
from chunkcache.integrations.llama_index_chat import ChunkCacheChatEngine

TEXTS = [
    "Alpha: json.dumps serializes an object to a JSON formatted string.",
    "Bravo: json.loads parses a JSON string into Python objects.",
    "Charlie: pathlib.Path joins paths with the / operator.",
]
ANSWER = FakeBackend().answer


class SliceRetriever(BaseRetriever):
    """The query names a start index; returns the two texts from there."""

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        start = int(query_bundle.query_str)
        return [NodeWithScore(node=TextNode(text=t), score=1.0) for t in TEXTS[start : start + 2]]


def make_llm(backend: FakeBackend | None = None, **kwargs: Any) -> ChunkCacheLLM:
    return ChunkCacheLLM(cache=ChunkCache(backend=backend or FakeBackend()), **kwargs)


def backend_of(llm: ChunkCacheLLM) -> FakeBackend:
    backend = llm.cache.backend
    assert isinstance(backend, FakeBackend)
    return backend


def chunk_ids(request: GenerationRequest) -> list[str]:
    return [s.chunk_id for s in request.segments if isinstance(s, ChunkSegment)]


def user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role=MessageRole.USER, content=text)]


def test_retrieved_chunks_are_found_in_a_query_engine_prompt() -> None:
    llm = make_llm()
    retriever = ChunkCacheRetriever(SliceRetriever(), cache=llm.cache, ordering="retriever")
    engine = RetrieverQueryEngine.from_args(retriever, llm=llm)
    response = engine.query("1")
    assert str(response) == ANSWER
    request = backend_of(llm).requests[-1]
    assert chunk_ids(request) == [chunk_id(TEXTS[1]), chunk_id(TEXTS[2])]


def test_complete_sends_the_prompt_as_is_and_chat_uses_the_template() -> None:
    llm = make_llm(completion_to_prompt=lambda p: f"[{p}]")
    llm.complete("plain")
    llm.complete("plain", formatted=True)
    llm.chat([ChatMessage(role=MessageRole.SYSTEM, content="sys"), *user("hi")])
    texts = ["".join(s.text for s in r.segments) for r in backend_of(llm).requests]
    assert texts[:2] == ["[plain]", "plain"]
    assert texts[2] == FakeBackend().render_chat(
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    )


def test_explicit_chunks_nodes_or_pairs() -> None:
    llm = make_llm()
    prompt = f"Context: {TEXTS[0]}\nWhat does it do?"
    node = TextNode(text=TEXTS[0], metadata={"chunk_id": "node-1"})
    llm.complete(prompt, chunks=[TextNode(text=TEXTS[0])])
    llm.complete(prompt, chunks=[NodeWithScore(node=node, score=0.5)])
    llm.chat(user(prompt), chunks=[("pair-1", TEXTS[0])])
    llm.complete(prompt)
    requests = backend_of(llm).requests
    bound = chunk_id_for(TEXTS[0], node.metadata)
    assert [chunk_ids(r) for r in requests] == [[chunk_id(TEXTS[0])], [bound], ["pair-1"], []]
    with pytest.raises(TypeError, match="list of nodes"):
        llm.complete(prompt, chunks=node)


def test_stats_in_additional_kwargs_and_raw() -> None:
    llm = make_llm()
    prompt = f"Context: {TEXTS[0]}\n{TEXTS[1]}\nQuestion?"
    pairs = [(chunk_id(t), t) for t in TEXTS[:2]]
    llm.complete(prompt, chunks=pairs)
    completion = llm.complete(prompt, chunks=pairs)
    chat = llm.chat(user(prompt), chunks=pairs)
    for response in (completion, chat):
        stats = response.additional_kwargs["chunkcache"]
        assert (stats["chunk_hits"], stats["reused_tokens"] > 0) == (2, True)
        assert response.raw is not None and response.raw["chunkcache"] == stats
        assert get_tokens_from_response(response) == (
            stats["prompt_tokens"],
            stats["completion_tokens"],
        )
    assert chat.message.role == MessageRole.ASSISTANT and chat.message.content == ANSWER


def test_streams_are_incremental_and_the_last_response_has_stats() -> None:
    llm = make_llm()
    completions = list(llm.stream_complete("hi"))
    chats = list(llm.stream_chat(user("hi")))
    for responses in (completions, chats):
        assert len(responses) == len(ANSWER.split()) > 1
        assert "".join(r.delta or "" for r in responses) == ANSWER
        assert all("chunkcache" not in r.additional_kwargs for r in responses[:-1])
        assert "chunkcache" in responses[-1].additional_kwargs
    assert [r.text for r in completions][:2] == ["The", "The answer"]
    assert chats[-1].message.content == ANSWER


async def test_async_variants() -> None:
    llm = make_llm()
    assert (await llm.acomplete("hi")).text == ANSWER
    chat = await llm.achat(user("hi"))
    assert chat.message.content == ANSWER and "chunkcache" in chat.additional_kwargs
    deltas = [r.delta async for r in await llm.astream_complete("hi")]
    assert "".join(d or "" for d in deltas) == ANSWER


@pytest.mark.parametrize("method", ["astream_complete", "astream_chat"])
async def test_async_streams_yield_before_the_backend_finishes(method: str) -> None:
    backend = GatedBackend()
    llm = make_llm(backend)
    prompt: Any = "hi" if method == "astream_complete" else user("hi")
    stream = await getattr(llm, method)(prompt)
    first = await anext(stream)  # the backend is still blocked on its gate
    assert first.delta == "The" and not backend.closed.is_set()
    backend.gate.set()
    rest = [response async for response in stream]
    assert "chunkcache" in rest[-1].additional_kwargs and backend.closed.is_set()


def test_stop_on_the_instance_and_per_call() -> None:
    llm = make_llm(stop=[" in"])
    assert llm.complete("hi").text == "The answer is"
    assert llm.chat(user("hi"), stop=[" is"]).message.content == "The answer"
    assert backend_of(llm).requests[-1].sampling.stop == (" is",)


def test_conversation_id_bound_or_per_call() -> None:
    llm = make_llm()
    bound = llm.for_conversation("conv-1")
    bound.complete("a")
    bound.chat(user("a"), conversation_id="other")
    llm.complete("a")
    assert [r.conversation_id for r in backend_of(llm).requests] == ["conv-1", "other", None]
    assert bound.cache is llm.cache and llm.conversation_id is None
    with pytest.raises(InvalidConversationIdError):
        llm.for_conversation("")


def test_chat_engine_composes_with_a_bound_llm() -> None:
    llm = make_llm().for_conversation("conv-7")
    engine = ChunkCacheChatEngine.from_defaults(
        SliceRetriever(), llm=llm, conversation_id="conv-7", cache=llm.cache
    )
    engine.chat("0")
    answer = engine.chat("1")
    assert str(answer) == ANSWER
    requests = backend_of(llm).requests
    assert [r.conversation_id for r in requests] == ["conv-7", "conv-7"]
    assert sorted(chunk_ids(requests[1])) == sorted(chunk_id(t) for t in TEXTS)
    assert [len(chunk_ids(r)) for r in requests] == [2, 3]  # turn 2 adds one new chunk


def test_metadata_from_the_backend() -> None:
    metadata = make_llm(max_tokens=64).metadata
    assert (metadata.context_window, metadata.num_output) == (2048, 64)
    assert (metadata.model_name, metadata.is_chat_model) == ("fake-chatml", True)

    class NoWindow(FakeBackend):
        context_window = None

    assert make_llm(NoWindow()).metadata.context_window == 3900  # LlamaIndex's default


def test_images_tools_and_unknown_options_are_refused() -> None:
    llm = make_llm()
    image = ChatMessage(
        role=MessageRole.USER, blocks=[TextBlock(text="What?"), ImageBlock(url="https://x/y.png")]
    )
    with pytest.raises(ValueError, match="text only"):
        llm.chat([image])
    with pytest.raises(ValueError, match="no tool calling"):
        llm.chat([ChatMessage(role=MessageRole.TOOL, content="42")])
    with pytest.raises(TypeError, match="unsupported arguments \\['tools'\\]"):
        llm.complete("hi", tools=[])
    assert backend_of(llm).requests == []


@pytest.mark.parametrize(
    "settings",
    [
        {"recompute": "magic"},
        {"recompute_ratio": 1.5},
        {"max_tokens": 0},
        {"temperature": -1.0},
        {"conversation_id": ""},
    ],
)
def test_invalid_settings_are_rejected_at_construction(settings: dict[str, Any]) -> None:
    with pytest.raises((ValidationError, InvalidConversationIdError)):
        make_llm(**settings)


def test_default_cache_when_none_given() -> None:
    assert ChunkCacheLLM().cache is default_cache()
    assert ChunkCacheLLM(cache=None).cache is default_cache()  # type: ignore[arg-type]


@pytest.mark.slow
async def test_on_the_local_engine_a_conversation_reuses_its_prefix() -> None:
    local_backend = pytest.importorskip("chunkcache.core.local_backend")
    cache = ChunkCache(backend=local_backend.LocalBackend.default())
    llm = ChunkCacheLLM(cache=cache, max_tokens=16).for_conversation("conv-local")
    question = user(f"Context: {TEXTS[0]}\n\nWhat does json.dumps return?")
    first = llm.chat(question, chunks=[("alpha", TEXTS[0])])
    assert first.message.content and first.additional_kwargs["chunkcache"]["chunk_misses"] == 1
    follow_up = [*question, first.message, *user("And json.loads?")]
    responses = [r async for r in await llm.astream_chat(follow_up)]
    stats = responses[-1].additional_kwargs["chunkcache"]
    assert stats["reused_tokens"] > 0 and stats["prompt_tokens"] > stats["reused_tokens"]
    assert "".join(r.delta or "" for r in responses) == responses[-1].message.content

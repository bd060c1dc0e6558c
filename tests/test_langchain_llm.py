"""LangChain ChunkCacheLLM on the fake backend: chunks, stats, streaming, config, errors."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fake_backend import FakeBackend, GatedBackend
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.chat_history import InMemoryChatMessageHistory
from langchain_core.documents import Document
from langchain_core.messages import (
    AIMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig, RunnableLambda, RunnablePassthrough
from langchain_core.runnables.history import RunnableWithMessageHistory
from langchain_tests.unit_tests import ChatModelUnitTests
from pydantic import ValidationError

from chunkcache.core import ChunkCache, chunk_id, default_cache
from chunkcache.core.chunk_ids import chunk_id_for
from chunkcache.core.generation import GenerationRequest
from chunkcache.core.segmenter import ChunkSegment
from chunkcache.integrations.langchain import ChunkCacheLLM, ChunkCacheRetriever
from chunkcache.integrations.langchain_history import chunk_chat_prompt, with_chunk_history

TEXTS = [
    "Alpha: json.dumps serializes an object to a JSON formatted string.",
    "Bravo: json.loads parses a JSON string into Python objects.",
    "Charlie: pathlib.Path joins paths with the / operator.",
    "Delta: itertools.chain iterates over several iterables in turn.",
]
STATS_KEYS = {
    "ttft_s",
    "prompt_tokens",
    "reused_tokens",
    "recomputed_tokens",
    "computed_tokens",
    "chunk_hits",
    "chunk_misses",
    "policy",
}


class SliceRetriever(BaseRetriever):
    """The query names a start index; returns the two texts from there."""

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        start = int(query)
        return [Document(page_content=t) for t in TEXTS[start : start + 2]]


def make_llm(backend: FakeBackend | None = None, **kwargs: Any) -> ChunkCacheLLM:
    return ChunkCacheLLM(chunk_cache=ChunkCache(backend=backend or FakeBackend()), **kwargs)


def backend_of(llm: ChunkCacheLLM) -> FakeBackend:
    backend = llm.chunk_cache.backend
    assert isinstance(backend, FakeBackend)
    return backend


def chunk_ids(request: GenerationRequest) -> list[str]:
    return [s.chunk_id for s in request.segments if isinstance(s, ChunkSegment)]


def session(key: str, value: str) -> RunnableConfig:
    return RunnableConfig(configurable={key: value})


def test_retrieved_chunks_are_found_in_a_prompt_from_any_template() -> None:
    llm = make_llm()
    retriever = ChunkCacheRetriever(
        base_retriever=SliceRetriever(), cache=llm.chunk_cache, ordering="retriever"
    )
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Be brief."), ("human", "<docs>\n{context}\n</docs>\n~~ {question} ~~")]
    )

    def join(docs: list[Document]) -> str:
        return "\n---\n".join(d.page_content for d in docs)

    context = retriever | RunnableLambda(join)
    chain = {"context": context, "question": RunnablePassthrough()} | prompt | llm
    chain.invoke("1")
    request = backend_of(llm).requests[-1]
    assert chunk_ids(request) == [chunk_id(TEXTS[1]), chunk_id(TEXTS[2])]
    rendered = "".join(s.text for s in request.segments)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<docs>")


def test_explicit_chunks_documents_or_pairs() -> None:
    llm = make_llm()
    prompt = f"Context: {TEXTS[0]}\nWhat does it do?"
    llm.invoke(prompt, chunks=[Document(page_content=TEXTS[0])])
    llm.invoke(prompt, chunks=[Document(page_content=TEXTS[0], metadata={"chunk_id": "doc-1"})])
    llm.invoke(prompt, chunks=[("pair-1", TEXTS[0])])
    llm.invoke(prompt)  # nothing registered, nothing named
    requests = backend_of(llm).requests
    bound = chunk_id_for(TEXTS[0], {"chunk_id": "doc-1"})
    assert [chunk_ids(r) for r in requests] == [[chunk_id(TEXTS[0])], [bound], ["pair-1"], []]
    with pytest.raises(TypeError, match="list of Documents"):
        llm.invoke(prompt, chunks=TEXTS[0])


def test_stats_in_usage_and_response_metadata() -> None:
    llm = make_llm(recompute_ratio=0.5)
    prompt = f"Context: {TEXTS[0]}\n{TEXTS[1]}\nQuestion?"
    pairs = [(chunk_id(t), t) for t in TEXTS[:2]]
    first = llm.invoke(prompt, chunks=pairs)
    second = llm.invoke(prompt, chunks=pairs)
    assert first.usage_metadata is not None and second.usage_metadata is not None
    assert first.usage_metadata["input_token_details"] == {"cache_read": 0}
    stats = second.response_metadata["chunkcache"]
    assert stats.keys() >= STATS_KEYS
    assert (stats["chunk_hits"], stats["chunk_misses"], stats["policy"]) == (2, 0, "cacheblend")
    assert stats["reused_tokens"] > 0 and stats["recomputed_tokens"] > 0
    assert second.usage_metadata["input_token_details"] == {"cache_read": stats["reused_tokens"]}
    assert second.usage_metadata["input_tokens"] == stats["prompt_tokens"]
    assert second.usage_metadata["output_tokens"] == len(str(second.content).split())
    assert second.response_metadata["model_name"] == "fake-chatml"
    assert second.response_metadata["finish_reason"] == "stop"


def test_stream_is_incremental_and_the_last_chunk_has_usage() -> None:
    llm = make_llm()
    chunks = list(llm.stream("Hello"))
    assert len(chunks) == len(FakeBackend().answer.split()) > 1
    assert all(c.usage_metadata is None and not c.response_metadata for c in chunks[:-1])
    last = chunks[-1]
    assert last.chunk_position == "last"
    assert last.usage_metadata is not None and "chunkcache" in last.response_metadata
    assert "".join(str(c.content) for c in chunks) == llm.invoke("Hello").content


async def test_astream_yields_before_the_backend_finishes() -> None:
    backend = GatedBackend()
    stream = make_llm(backend).astream("Hello")
    first = await anext(stream)  # the backend is still blocked on its gate
    assert first.content == "The" and not backend.closed.is_set()
    backend.gate.set()
    rest = [chunk async for chunk in stream]
    assert rest[-1].usage_metadata is not None
    assert backend.closed.is_set()


async def test_ainvoke_and_abatch() -> None:
    llm = make_llm()
    assert (await llm.ainvoke("Hello")).content == FakeBackend().answer
    results = await llm.abatch(["a", "b"], config=session("session_id", "s1"))
    assert [r.content for r in results] == [FakeBackend().answer] * 2
    assert [r.conversation_id for r in backend_of(llm).requests[-2:]] == ["s1", "s1"]


def test_stop_at_call_time_and_on_the_instance() -> None:
    llm = make_llm()
    assert llm.invoke("hi", stop=[" is"]).content == "The answer"
    assert backend_of(llm).requests[-1].sampling.stop == (" is",)
    assert "".join(str(c.content) for c in llm.stream("hi", stop=[" is"])) == "The answer"
    stopping = make_llm(stop=[" in"])
    assert stopping.invoke("hi").content == "The answer is"
    assert stopping.invoke("hi", stop=[" answer"]).content == "The"
    with pytest.raises(TypeError, match="not one str"):
        llm.invoke("hi", stop="x")  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore::langchain_core._api.beta_decorator.LangChainBetaWarning")
@pytest.mark.parametrize("key", ["conversation_id", "session_id", "thread_id"])
async def test_conversation_id_from_config_reaches_the_backend(key: str) -> None:
    llm = make_llm()
    config = session(key, "conv-1")
    llm.invoke("a", config=config)
    list(llm.stream("a", config=config))
    llm.batch(["a"], config=config)
    list(llm.stream_events("a", config, version="v3"))
    await llm.ainvoke("a", config=config)
    _ = [chunk async for chunk in llm.astream("a", config=config)]
    _ = [event async for event in llm.astream_events("a", config, version="v2")]
    requests = backend_of(llm).requests
    assert [r.conversation_id for r in requests] == ["conv-1"] * 7
    llm.invoke("a", config=config, conversation_id="explicit")
    llm.invoke("a")
    assert [r.conversation_id for r in requests[-2:]] == ["explicit", None]


def test_runnable_with_message_history_passes_the_session() -> None:
    llm = make_llm()
    histories: dict[str, InMemoryChatMessageHistory] = {}
    prompt = ChatPromptTemplate.from_messages(
        [MessagesPlaceholder("history"), ("human", "{question}")]
    )
    chain = RunnableWithMessageHistory(
        prompt | llm,
        lambda sid: histories.setdefault(sid, InMemoryChatMessageHistory()),
        input_messages_key="question",
        history_messages_key="history",
    )
    for question in ("first?", "second?"):
        chain.invoke({"question": question}, config=session("session_id", "s-7"))
    assert [r.conversation_id for r in backend_of(llm).requests] == ["s-7", "s-7"]
    assert len(histories["s-7"].messages) == 4


def test_with_chunk_history_reuses_earlier_turns_chunks() -> None:
    llm = make_llm()
    histories: dict[str, InMemoryChatMessageHistory] = {}
    retriever = ChunkCacheRetriever(
        base_retriever=SliceRetriever(), cache=llm.chunk_cache, dedupe="drop"
    )
    chain = with_chunk_history(
        chunk_chat_prompt("Answer from the context.") | llm,
        retriever,
        lambda sid: histories.setdefault(sid, InMemoryChatMessageHistory()),
    )
    config = session("session_id", "s-9")
    first = chain.invoke({"question": "0"}, config=config)
    second = chain.invoke({"question": "1"}, config=config)
    requests = backend_of(llm).requests
    assert [r.conversation_id for r in requests] == ["s-9", "s-9"]
    assert sorted(chunk_ids(requests[1])) == sorted(chunk_id(t) for t in TEXTS[:3])
    assert first.response_metadata["chunkcache"]["chunk_hits"] == 0
    assert second.response_metadata["chunkcache"]["chunk_hits"] == 2  # turn 1's chunks


def test_messages_render_with_their_roles_and_text_blocks() -> None:
    llm = make_llm()
    llm.invoke(
        [
            SystemMessage("sys"),
            HumanMessage(content=[{"type": "text", "text": "a"}, "b"]),
            AIMessage("ans"),
            HumanMessage("q"),
        ]
    )
    (segment,) = backend_of(llm).requests[-1].segments
    assert segment.text == FakeBackend().render_chat(
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "ab"},
            {"role": "assistant", "content": "ans"},
            {"role": "user", "content": "q"},
        ]
    )


@pytest.mark.parametrize(
    ("role", "sent_as"),
    [("developer", "system"), ("human", "user"), ("ai", "assistant"), ("model", "assistant")],
)
def test_chat_messages_of_other_providers_roles_are_sent_as_their_turn(
    role: str, sent_as: str
) -> None:
    llm = make_llm()
    llm.invoke([ChatMessage(role=role, content="x"), HumanMessage("q")])
    (segment,) = backend_of(llm).requests[-1].segments
    assert segment.text == FakeBackend().render_chat(
        [{"role": sent_as, "content": "x"}, {"role": "user", "content": "q"}]
    )


def test_a_chat_message_of_an_unknown_role_is_refused_by_its_role() -> None:
    llm = make_llm()
    with pytest.raises(ValueError, match="message of role 'narrator'"):
        llm.invoke([ChatMessage(role="narrator", content="x")])
    assert backend_of(llm).requests == []


def test_images_tools_and_unknown_options_are_refused() -> None:
    llm = make_llm()
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    with pytest.raises(ValueError, match="text only"):
        llm.invoke([HumanMessage(content=[{"type": "text", "text": "What is it?"}, image])])
    with pytest.raises(ValueError, match="no tool calling"):
        llm.invoke([HumanMessage("hi"), ToolMessage("42", tool_call_id="call-1")])
    with pytest.raises(TypeError, match="unsupported arguments \\['model'\\]"):
        llm.invoke("hi", model="other-model")
    with pytest.raises(NotImplementedError):
        llm.bind_tools([])
    assert backend_of(llm).requests == []


def test_per_call_options_override_the_constructor() -> None:
    llm = make_llm(max_tokens=3)
    llm.invoke("hi", recompute="full", recompute_ratio=0.3, temperature=0.5, top_p=0.9, seed=7)
    request = backend_of(llm).requests[-1]
    assert (request.policy, request.recompute_ratio) == ("full", 0.3)
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.seed) == (
        3,
        0.5,
        0.9,
        7,
    )
    with pytest.raises(ValueError, match="unknown recompute policy"):
        llm.invoke("hi", recompute="magic")


@pytest.mark.parametrize(
    "settings",
    [
        {"recompute": "magic"},
        {"recompute_ratio": 1.5},
        {"recompute_ratio": -0.1},
        {"max_tokens": 0},
        {"temperature": -1.0},
        {"top_p": -0.1},
    ],
)
def test_invalid_settings_are_rejected_at_construction(settings: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        make_llm(**settings)


def test_chunk_cache_given_as_cache_or_chunk_cache_or_defaulted() -> None:
    cache = ChunkCache(backend=FakeBackend())
    assert ChunkCacheLLM(chunk_cache=cache).chunk_cache is cache
    # cache= as on the retrievers (at run time; type checkers know LangChain's cache field)
    assert ChunkCacheLLM(cache=cache).chunk_cache is cache  # type: ignore[arg-type]
    assert ChunkCacheLLM().chunk_cache is default_cache()
    with pytest.raises(ValidationError, match="once"):
        ChunkCacheLLM(cache=cache, chunk_cache=cache)  # type: ignore[arg-type]
    llm = ChunkCacheLLM(cache=False, chunk_cache=cache)  # LangChain's response cache: off
    assert llm.cache is False and llm.invoke("hi").content


async def test_abandoned_astream_closes_the_backend_stream() -> None:
    backend = GatedBackend()
    stream = make_llm(backend).astream("Hello")
    await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    for _ in range(100):
        if backend.closed.is_set():
            break
        await asyncio.sleep(0.01)
    assert backend.closed.is_set()


class TestChunkCacheLLMUnit(ChatModelUnitTests):
    """langchain-tests' standard unit suite, on the fake backend."""

    @property
    def chat_model_class(self) -> type[ChunkCacheLLM]:
        return ChunkCacheLLM

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"chunk_cache": ChunkCache(backend=FakeBackend())}

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

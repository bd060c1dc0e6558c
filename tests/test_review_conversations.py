"""Review of how conversations are handled: bounds over many conversations and turns,
malformed conversation ids, threads, multi-turn exactness on a tiny model, and chunk
texts shared, changed, empty or huge."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from fake_backend import FakeBackend
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.chat_history import InMemoryChatMessageHistory
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig
from tiny_models import TOLERANCE, tiny_lm, tiny_tokenizer

from chunkcache.core.cache import ChunkCache
from chunkcache.core.engine import ChunkEngine, Prefilled, TokenSegment
from chunkcache.core.errors import InvalidConversationIdError
from chunkcache.core.ledger import ConversationLedger
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.registry import ChunkRegistry
from chunkcache.core.retrieval import plan_retrieval
from chunkcache.integrations.langchain import ChunkCacheLLM, ChunkCacheRetriever
from chunkcache.integrations.langchain_history import chunk_chat_prompt, with_chunk_history

TEXTS = [f"Fact {i}: the value of item {i} is {i * 7}, as the manual says." for i in range(40)]


class WindowRetriever(BaseRetriever):
    """The query is a start index; returns ``width`` consecutive :data:`TEXTS`."""

    texts: list[str] = TEXTS
    width: int = 3
    calls: int = 0

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        self.calls += 1
        start = int(query)
        return [Document(page_content=t) for t in self.texts[start : start + self.width]]


def retriever(cache: ChunkCache, **kwargs: Any) -> ChunkCacheRetriever:
    return ChunkCacheRetriever(base_retriever=WindowRetriever(), cache=cache, **kwargs)


# Memory bounds: counts, over many conversations and many turns.


def test_many_conversations_stay_within_every_bound() -> None:
    cache = ChunkCache(window=4, backend=FakeBackend())
    wrapped = retriever(cache, dedupe="drop")
    for i in range(120):
        wrapped.invoke(str(i % 37), conversation_id=f"conversation-{i}")
    assert len(cache.ledger) == 2 * 4  # the most recently active conversations
    assert cache.access_table.num_requests == 4
    assert len(cache.access_table) <= 4 * 3
    assert len(cache.registry) <= 20 * 4
    assert len(cache.prefix_tree) <= 16 * 4


def test_many_turns_of_one_conversation_stay_within_its_chunk_bound() -> None:
    ledger = ConversationLedger(max_chunks_per_conversation=10)
    cache = ChunkCache(window=4, ledger=ledger, backend=FakeBackend())
    wrapped = retriever(cache, dedupe="drop")
    for turn in range(37):
        wrapped.invoke(str(turn), conversation_id="long")
    assert len(ledger.seen("long")) == 10
    assert len(ledger) == 1


# Malformed conversation ids: a clear error, before anything runs.


@pytest.mark.parametrize("bad", ["", "x" * 257, b"bytes", 1.5, True, ["a"]])
def test_an_unusable_conversation_id_fails_before_the_base_retriever_runs(bad: object) -> None:
    cache = ChunkCache(backend=FakeBackend())
    base = WindowRetriever()
    wrapped = ChunkCacheRetriever(base_retriever=base, cache=cache)
    with pytest.raises(InvalidConversationIdError):
        wrapped.invoke("0", conversation_id=bad)
    assert base.calls == 0
    assert (len(cache.registry), cache.num_requests) == (0, 0)


def test_plan_retrieval_checks_the_conversation_id_before_registering() -> None:
    cache = ChunkCache(backend=FakeBackend())
    with pytest.raises(InvalidConversationIdError):
        plan_retrieval(
            [(TEXTS[0], None)], cache, conversation_id="", ordering="tree", dedupe="drop"
        )
    assert len(cache.registry) == 0


@pytest.mark.parametrize("good", ["会話-😀", "x" * 256, 7, " "])
def test_unicode_long_and_int_conversation_ids_dedupe(good: object) -> None:
    cache = ChunkCache(backend=FakeBackend())
    wrapped = retriever(cache, dedupe="drop")
    wrapped.invoke("0", conversation_id=good)
    again = wrapped.invoke("1", conversation_id=good)
    assert [doc.page_content for doc in again] == [TEXTS[3]]
    assert str(good) in cache.ledger


def test_the_llm_refuses_an_empty_conversation_id_from_the_config() -> None:
    llm = ChunkCacheLLM(chunk_cache=ChunkCache(backend=FakeBackend()), max_tokens=2)
    with pytest.raises(InvalidConversationIdError):
        llm.invoke("hello", config={"configurable": {"session_id": ""}})


# Threads: dedupe stays per conversation and consistent.


def test_threads_in_one_and_in_different_conversations_mark_each_chunk_once() -> None:
    cache = ChunkCache(backend=FakeBackend())
    wrapped = retriever(cache, dedupe="mark")
    unseen: dict[str, Counter[str]] = {"A": Counter(), "B": Counter()}
    lock = threading.Lock()
    barrier = threading.Barrier(4)

    def work(conversation: str, offset: int) -> None:
        barrier.wait()
        for i in range(25):
            docs = wrapped.invoke(str((i * 3 + offset) % 30), conversation_id=conversation)
            fresh = [d.metadata["chunk_id"] for d in docs if not d.metadata["seen_in_conversation"]]
            with lock:
                unseen[conversation].update(fresh)

    threads = [
        threading.Thread(target=work, args=(conversation, offset))
        for conversation in "AB"
        for offset in (0, 7)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for conversation in "AB":
        # Every chunk the conversation retrieved was new to it exactly once.
        assert set(unseen[conversation].values()) == {1}
        assert set(unseen[conversation]) == cache.ledger.seen(conversation)
    assert unseen["A"].keys() == unseen["B"].keys()  # one conversation's chunks never hide


# Multi-turn exactness on a tiny model, through the LangChain layout helper.

WORDS = [" ".join(f"w{3 + (7 * i + j) % 120}" for j in range(12)) for i in range(8)]


class RecordingEngine(ChunkEngine):
    """Keeps every prefill's segments and result."""

    def __init__(self, lm: LoadedModel) -> None:
        super().__init__(lm)
        self.prefills: list[tuple[list[TokenSegment], Prefilled]] = []

    def prefill(self, segments: Sequence[TokenSegment], *args: Any, **kwargs: Any) -> Prefilled:
        out = super().prefill(segments, *args, **kwargs)
        self.prefills.append((list(segments), out))
        return out


def ids_of(segments: list[TokenSegment]) -> list[int]:
    return [token for segment in segments for token in segment.ids]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    lm, tokenizer = tiny_lm("llama"), tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return LoadedModel(lm.hf, tokenizer, lm.spec, lm.rope, lm.fingerprint)


def test_turn_two_reuses_turn_one_exactly_and_an_edited_history_is_not_reused(
    tiny: LoadedModel,
) -> None:
    engine = RecordingEngine(tiny)
    cache = ChunkCache(backend=LocalBackend(engine))
    base = WindowRetriever(texts=WORDS, width=2)
    history = InMemoryChatMessageHistory()
    chain = with_chunk_history(
        chunk_chat_prompt("w1 w2 w3")
        | ChunkCacheLLM(chunk_cache=cache, max_tokens=4, recompute="prefix"),
        ChunkCacheRetriever(base_retriever=base, cache=cache, dedupe="drop"),
        lambda session_id: history,
        turn_template="w4 {context} w5 {question}",
    )
    config = RunnableConfig(configurable={"session_id": "s"})

    def full_logits(segments: list[TokenSegment]) -> torch.Tensor:
        return ChunkEngine(tiny).prefill(segments, "full").logits

    chain.invoke({"question": "0"}, config=config)
    chain.invoke({"question": "1"}, config=config)
    (turn1, _), (turn2, second) = engine.prefills
    assert ids_of(turn2)[: len(ids_of(turn1))] == ids_of(turn1)
    assert second.stats.extra["prefix_tokens"] >= len(ids_of(turn1))
    assert second.exact_until == len(second.ids)
    assert (second.logits - full_logits(turn2)).abs().max().item() < TOLERANCE

    # The app rewrites turn 1's first word: nothing past the edit may come from the past.
    first = history.messages[0]
    assert str(first.content).startswith("w4 ")
    history.messages[0] = first.model_copy(update={"content": f"w6{str(first.content)[2:]}"})
    chain.invoke({"question": "2"}, config=config)
    turn3, third = engine.prefills[-1]
    edit = first_difference(ids_of(turn3), ids_of(turn2))
    assert edit == 3  # after the system prompt's three words
    assert third.stats.extra["prefix_tokens"] == edit
    assert (third.logits - full_logits(turn3)).abs().max().item() < TOLERANCE


# Chunk texts: shared by two ids, changed under one id, empty, huge.


def test_one_text_under_two_ids_is_two_chunks_and_a_changed_text_is_new() -> None:
    cache = ChunkCache(backend=FakeBackend())
    documents: list[tuple[str, dict[str, Any] | None]] = [
        (TEXTS[0], {"chunk_id": "doc-1"}),
        (TEXTS[0], {"chunk_id": "doc-2"}),
        (TEXTS[0], None),
    ]
    plan = plan_retrieval(
        documents, cache, conversation_id="c", ordering="retriever", dedupe="drop"
    )
    assert plan is not None
    ids = [chunk.chunk_id for chunk in plan.chunks]
    assert len(set(ids)) == 3 and plan.num_collapsed == 0
    assert all(cache.registry.get(cid) == TEXTS[0] for cid in ids)
    edited = plan_retrieval(
        [(TEXTS[1], {"chunk_id": "doc-1"})],
        cache,
        conversation_id="c",
        ordering="retriever",
        dedupe="drop",
    )
    assert edited is not None and edited.dropped_chunk_ids == []
    assert edited.chunks[0].chunk_id not in ids


def test_empty_documents_are_left_out_and_a_huge_one_is_returned_unregistered() -> None:
    cache = ChunkCache(registry=ChunkRegistry(max_chars=1000), backend=FakeBackend())
    huge = "word " * 10_000
    plan = plan_retrieval(
        [("", None), ("  \n", None), (huge, None), (TEXTS[0], None)],
        cache,
        conversation_id="c",
        ordering="retriever",
        dedupe="drop",
    )
    assert plan is not None
    assert (plan.num_empty, len(plan.chunks)) == (2, 2)
    assert [chunk.source_index for chunk in plan.chunks] == [2, 3]
    assert len(cache.registry) == 1 and cache.registry.num_chars == len(TEXTS[0])

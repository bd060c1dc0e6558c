"""A chat turn that trims its history and runs the retriever again (``dedupe="drop"``:
chunks dropped as repeats left the prompt with the trimmed turns) is still one request: the
access table, whose counts order the chunks, counts its chunks once."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from test_history_token_budget import (
    CONFIG,
    TURNS,
    langchain_chat,
    llama_index_chat,
    one_torch_thread,  # noqa: F401  (autouse)
    question,
    recording_cache,
    texts_for,
    tiny_smollm2,  # noqa: F401  (fixture)
)

from chunkcache.core.cache import ChunkCache
from chunkcache.core.chunk_ids import chunk_id
from chunkcache.core.models import LoadedModel
from chunkcache.core.retrieval import RetrievalPlan, plan_retrieval, replanning

Turn = Callable[[str], Any]
AsyncTurn = Callable[[str], Awaitable[Any]]


def plan_abc(cache: ChunkCache) -> RetrievalPlan | None:
    documents = [(text, None) for text in "ABC"]
    return plan_retrieval(
        documents, cache, conversation_id="chat", ordering="retriever", dedupe="drop"
    )


def test_a_request_planned_again_is_deduped_but_not_counted_again() -> None:
    cache = ChunkCache()
    a, b, c = (chunk_id(text) for text in "ABC")
    plan_abc(cache)
    cache.ledger.replace("chat", [a])  # the turns that held B and C were trimmed
    with replanning():
        again = plan_abc(cache)
    assert again is not None and [chunk.chunk_id for chunk in again.chunks] == [b, c]
    assert again.dropped_chunk_ids == [a]
    assert [cache.access_table.count(cid) for cid in (a, b, c)] == [1, 1, 1]
    assert (cache.num_requests, cache.access_table.num_requests) == (1, 1)
    plan_abc(cache)  # a new request, outside replanning, is counted
    assert [cache.access_table.count(cid) for cid in (a, b, c)] == [2, 2, 2]


def test_a_request_planned_again_does_not_visit_the_prefix_tree_again() -> None:
    cache = ChunkCache()
    for _ in range(2):  # counts reach the promotion threshold: A, B, C is a tree path
        plan_abc(cache)
        cache.ledger.replace("chat", [])
    visits = [node.visits for node in cache.prefix_tree.iter_nodes()]
    with replanning():
        plan_abc(cache)
    assert [node.visits for node in cache.prefix_tree.iter_nodes()] == visits == [1, 1, 1]


def counting_arrangements(cache: ChunkCache) -> list[int]:
    """``cache.arrange`` counting its calls: the retrievals planned, re-runs included."""
    calls: list[int] = []
    arrange = cache.arrange

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return arrange(*args, **kwargs)

    cache.arrange = counted  # type: ignore[method-assign]
    return calls


def counts(cache: ChunkCache, i: int) -> list[int]:
    """Access counts of the chunks turn ``i`` retrieves, then the requests in the table."""
    ids = [chunk_id(text, cache.namespace) for text in texts_for(question(i))]
    return [*map(cache.access_table.count, ids), cache.access_table.num_requests]


def assert_each_turn_counted_once(cache: ChunkCache, before: list[int], i: int) -> None:
    assert counts(cache, i) == [n + 1 for n in before]
    assert cache.num_requests == i + 1


def check_turns(cache: ChunkCache, turn: Turn) -> None:
    plans = counting_arrangements(cache)
    for i in range(TURNS):
        before = counts(cache, i)
        turn(question(i))
        assert_each_turn_counted_once(cache, before, i)
    assert len(plans) > TURNS  # some turns trimmed and ran the retriever again


async def acheck_turns(cache: ChunkCache, turn: AsyncTurn) -> None:
    plans = counting_arrangements(cache)
    for i in range(TURNS):
        before = counts(cache, i)
        await turn(question(i))
        assert_each_turn_counted_once(cache, before, i)
    assert len(plans) > TURNS


def test_a_langchain_turn_that_retrieves_again_is_counted_once(
    tiny_smollm2: LoadedModel,  # noqa: F811
) -> None:
    cache, _ = recording_cache(tiny_smollm2)
    chat, _ = langchain_chat(cache)
    check_turns(cache, lambda q: chat.invoke({"question": q}, config=CONFIG))


async def test_an_async_langchain_turn_that_retrieves_again_is_counted_once(
    tiny_smollm2: LoadedModel,  # noqa: F811
) -> None:
    cache, _ = recording_cache(tiny_smollm2)
    chat, _ = langchain_chat(cache)
    await acheck_turns(cache, lambda q: chat.ainvoke({"question": q}, config=CONFIG))


def test_a_llama_index_turn_that_retrieves_again_is_counted_once(
    tiny_smollm2: LoadedModel,  # noqa: F811
) -> None:
    cache, _ = recording_cache(tiny_smollm2)
    check_turns(cache, llama_index_chat(cache).chat)


async def test_an_async_llama_index_turn_that_retrieves_again_is_counted_once(
    tiny_smollm2: LoadedModel,  # noqa: F811
) -> None:
    cache, _ = recording_cache(tiny_smollm2)
    await acheck_turns(cache, llama_index_chat(cache).achat)

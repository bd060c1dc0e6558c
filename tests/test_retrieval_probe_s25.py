"""Probe of the retriever-side shared state under a multi-user app's load: threads and
tasks on one cache, caches made per tenant on one backend, long streams of new chunks and
conversations, ids and orders that must not depend on the process."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import threading
import time
import unicodedata
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_store_support import FP, cache_on, make_variant, promoted

from chunkcache.core.access_table import AccessTable
from chunkcache.core.cache import Arrangement, ChunkCache
from chunkcache.core.chunk_ids import chunk_id, chunk_id_for, validate_chunk_id
from chunkcache.core.kv_store import MemoryKVStore
from chunkcache.core.ledger import DedupeMode
from chunkcache.core.ordering import Ordering
from chunkcache.core.retrieval import plan_retrieval, retrieval_scope

VARIANT_BYTES = make_variant("x").num_bytes


# --- a bad request fails alone -----------------------------------------------------------


@pytest.mark.parametrize("bad", [["a", 1], ["a", None], [1, 2]])
def test_a_request_with_a_non_str_chunk_id_fails_and_changes_nothing(bad: list[Any]) -> None:
    cache = ChunkCache(window=2)
    with pytest.raises(TypeError, match="chunk ids must be str"):
        cache.arrange(bad, conversation_id="u")
    assert cache.num_requests == 0
    assert cache.access_table.num_requests == 0 and len(cache.access_table) == 0
    assert "u" not in cache.ledger
    for ids in (["b"], ["c"], ["d"]):  # the window rolls past where the bad request was
        cache.arrange(ids, conversation_id="u", dedupe="drop")
    assert {cid: cache.access_table.count(cid) for cid in "bcd"} == {"b": 0, "c": 1, "d": 1}


def test_access_table_ids_that_cannot_be_sorted_leave_the_table_as_it_was() -> None:
    table = AccessTable(window=1)
    table.record(["a"])
    with pytest.raises(TypeError):
        table.record(["b", 1])  # type: ignore[list-item]
    assert table.num_requests == 1 and table.count("a") == 1 and "b" not in table
    table.record(["c"])  # pushes "a" out: the unsortable request was never kept
    assert (len(table), table.count("c")) == (1, 1)


# --- caches on one shared backend ----------------------------------------------------------


def test_a_cache_the_app_dropped_is_collected_and_not_called_on_evictions() -> None:
    store = MemoryKVStore(2 * VARIANT_BYTES)
    kept = cache_on(store)
    gone = [weakref.ref(cache_on(store)) for _ in range(50)]  # e.g. one per tenant request
    gc.collect()
    assert [ref() for ref in gone] == [None] * 50
    assert len(store.drop_listeners) == 1
    assert promoted(kept, ["a"]) == 1  # the cache still held still follows the store
    for segment_id in "abc":
        store.put(FP, make_variant(segment_id))  # capacity 2: evicts a
    assert len(kept.prefix_tree) == 0


def test_every_live_cache_on_a_store_follows_its_evictions() -> None:
    store = MemoryKVStore(2 * VARIANT_BYTES)
    caches = [cache_on(store) for _ in range(3)]
    for cache in caches:
        assert promoted(cache, ["a", "b"]) == 2
    store.put(FP, make_variant("a"))
    store.put(FP, make_variant("b"))
    store.put(FP, make_variant("c"))  # evicts a's only variant
    assert [len(cache.prefix_tree) for cache in caches] == [0, 0, 0]


# --- threads on one cache equal a sequential replay -----------------------------------------

Call = tuple[list[str], str, Ordering, DedupeMode]


def _calls(seed: int, texts: list[str]) -> Iterator[Call]:
    rng = random.Random(seed)
    for turn in range(150):
        ids = [chunk_id(rng.choice(texts[: 12 if rng.random() < 0.7 else None])) for _ in "123456"]
        ordering: Ordering = rng.choice(["tree", "frequency", "retriever"])
        dedupe: DedupeMode = rng.choice(["drop", "mark", "off"])
        yield ids[: rng.randint(1, 6)], f"user-{seed}-{turn % 3}", ordering, dedupe


def _state(cache: ChunkCache) -> dict[str, Any]:
    table = cache.access_table
    return {
        "counts": dict(table._counts),
        "first_seen": dict(table._first_seen),
        "tree": sorted((n.path(), n.visits) for n in cache.prefix_tree.iter_nodes()),
        "ledger": {c: sorted(cache.ledger.seen(c)) for c in cache.ledger._conversations},
        "requests": cache.num_requests,
    }


def test_threads_planning_and_evicting_at_once_end_as_a_sequential_replay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    texts = [f"Chunk {i}: the {i % 5}th topic, paragraph {i}." for i in range(40)]
    cache = ChunkCache(window=30)  # small: the window rolls and the tree trims often
    log: list[tuple[str, Any]] = []  # what entered the cache's lock, in order
    results: dict[tuple[int, int], Arrangement] = {}
    local = threading.local()
    record, remove = cache.access_table.record, cache.prefix_tree.remove_chunk

    def logged_record(ids: Any) -> None:
        log.append(("arrange", local.call))
        record(ids)

    def logged_remove(cid: str) -> int:
        log.append(("evict", cid))
        return remove(cid)

    monkeypatch.setattr(cache.access_table, "record", logged_record)
    monkeypatch.setattr(cache.prefix_tree, "remove_chunk", logged_remove)
    calls = {seed: list(_calls(seed, texts)) for seed in range(6)}
    errors: list[BaseException] = []
    barrier = threading.Barrier(7)

    def user(seed: int) -> None:
        barrier.wait()
        try:
            for n, (ids, conversation, ordering, dedupe) in enumerate(calls[seed]):
                time.sleep(0)  # let the other users in between every request
                local.call = (seed, n)
                results[seed, n] = cache.arrange(
                    ids, conversation_id=conversation, ordering=ordering, dedupe=dedupe
                )
                if n % 40 == 39:  # a chat that cleared its history
                    cache.ledger.forget(conversation)
                    log.append(("forget", conversation))
        except BaseException as error:  # surfaced below: threads swallow exceptions
            errors.append(error)

    def evictor() -> None:
        rng = random.Random(99)
        barrier.wait()
        for _ in range(300):
            time.sleep(0)
            cache._forget_chunk(chunk_id(rng.choice(texts)))  # as the store calls it

    threads = [threading.Thread(target=user, args=(s,)) for s in calls]
    threads.append(threading.Thread(target=evictor))
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == []

    replay = ChunkCache(window=30)
    # A forget is logged after the arrange before it returned; each conversation's turns
    # stay in their thread's order, so the ledger sees them as the threads did.
    for kind, what in log:
        if kind == "arrange":
            seed, n = what
            ids, conversation, ordering, dedupe = calls[seed][n]
            again = replay.arrange(
                ids, conversation_id=conversation, ordering=ordering, dedupe=dedupe
            )
            assert again == results[seed, n]
        elif kind == "evict":
            replay._forget_chunk(what)
        else:
            replay.ledger.forget(what)
    assert _state(replay) == _state(cache)
    assert len(cache.prefix_tree) <= cache.prefix_tree.max_nodes


# --- asyncio tasks sharing one cache -------------------------------------------------------


def test_a_scope_open_in_one_task_is_not_seen_by_a_sibling_or_a_plain_thread() -> None:
    cache = ChunkCache()
    doc = [("Alpha: json.dumps serializes an object.", None)]

    def plan(conversation: str) -> bool:
        planned = plan_retrieval(
            doc, cache, conversation_id=conversation, ordering="tree", dedupe="drop"
        )
        return planned is not None

    async def wrapper(inside: asyncio.Event, sibling_done: asyncio.Event) -> list[bool]:
        with retrieval_scope(cache, "a"):
            inside.set()
            await sibling_done.wait()  # the sibling plans while this scope is open
            thread_planned: list[bool] = []
            thread = threading.Thread(target=lambda: thread_planned.append(plan("t")))
            thread.start()
            thread.join()
            nested = await asyncio.to_thread(plan, "a")  # the base retriever's own thread
        return [*thread_planned, nested]

    async def sibling(inside: asyncio.Event, sibling_done: asyncio.Event) -> bool:
        await inside.wait()
        planned = plan("b")
        sibling_done.set()
        return planned

    async def main() -> tuple[list[bool], bool]:
        inside, done = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(wrapper(inside, done), sibling(inside, done))

    in_scope, sibling_planned = asyncio.run(main())
    assert sibling_planned and in_scope == [True, False]
    assert cache.num_requests == 2  # the sibling's and the thread's; the nested one is left
    assert cache.ledger.seen("a") == frozenset()  # to its scope, which never planned here


# --- bounded memory ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_long_stream_of_new_chunks_and_conversations_stays_within_every_bound() -> None:
    window = 10
    cache = ChunkCache(window=window)
    rng = random.Random(1)
    pool = [f"Pooled chunk {i} about a popular topic." for i in range(200)]
    peaks: dict[str, int] = {}
    for i in range(60_000):
        docs = [(f"New chunk {i}.{j}, never seen before.", None) for j in range(2)]
        docs += [(rng.choice(pool), None) for _ in range(4)]
        plan_retrieval(docs, cache, conversation_id=f"user-{i}", ordering="tree", dedupe="drop")
        if i % 500 == 0:
            sizes = {
                "table": len(cache.access_table),
                "first_seen": len(cache.access_table._first_seen),
                "tree": sum(1 for _ in cache.prefix_tree.iter_nodes()),
                "tree_index": len(cache.prefix_tree._nodes_of_chunk),
                "ledger": len(cache.ledger._conversations),
                "registry": len(cache.registry),
            }
            peaks = {k: max(v, peaks.get(k, 0)) for k, v in sizes.items()}
    assert peaks["table"] <= peaks["first_seen"] <= window * 6
    assert peaks["tree_index"] <= peaks["tree"] <= 16 * window
    assert peaks["ledger"] <= 2 * window
    assert peaks["registry"] <= 20 * window


def test_a_conversation_evicted_from_the_ledger_starts_afresh() -> None:
    cache = ChunkCache(window=1)  # the ledger keeps 2 conversations
    cache.arrange(["a", "b"], conversation_id="u", dedupe="drop")
    cache.arrange(["x"], conversation_id="v", dedupe="drop")
    cache.arrange(["y"], conversation_id="w", dedupe="drop")  # u is forgotten
    again = cache.arrange(["a", "b", "c"], conversation_id="u", dedupe="drop")
    assert (sorted(again.order), again.dropped, again.seen) == (["a", "b", "c"], [], frozenset())
    assert cache.arrange(["a"], conversation_id="v", dedupe="drop").dropped == []


# --- chunk ids ----------------------------------------------------------------------------


def test_ids_follow_the_readme_hash_of_the_nfc_text_and_nothing_else() -> None:
    text = "Café déjà vu"
    nfd = unicodedata.normalize("NFD", text)
    assert nfd != text and chunk_id(nfd) == chunk_id(text)
    variants = [text + " ", text + "\n", "\ufeff" + text, " " + text]
    assert len({chunk_id(v) for v in [text, *variants]}) == 5  # whitespace and a BOM are text


@pytest.mark.parametrize(
    "label",
    [7, 7.5, True, {"doc": 3, "part": 1}, ["a"], "x" * 10_000_000],
    ids=["int", "float", "bool", "dict", "list", "10MB-str"],
)
def test_any_metadata_chunk_id_gives_a_valid_id_bound_to_the_text(label: object) -> None:
    text = "Bravo: json.loads parses a JSON string."
    bound = chunk_id_for(text, {"chunk_id": label})
    assert validate_chunk_id(bound) == bound and bound.endswith("-" + chunk_id(text))
    assert chunk_id_for(text, {"chunk_id": bound}) == bound
    assert chunk_id_for("Other text.", {"chunk_id": label}) != bound


def test_a_metadata_chunk_id_of_none_is_no_label() -> None:
    assert chunk_id_for("Text.", {"chunk_id": None}) == chunk_id("Text.")


# --- the same orders in every process -----------------------------------------------------

_WORKLOAD = """
import json, random, sys
from chunkcache.core.cache import ChunkCache
from chunkcache.core.retrieval import plan_retrieval
cache = ChunkCache(window=20)
rng = random.Random(5)
pool = [f"Chunk {i} of the corpus." for i in range(40)]
out = []
for i in range(1500):
    docs = [(rng.choice(pool), {"chunk_id": rng.choice([None, 3, "doc", {"a": 1}])})
            for _ in range(rng.randint(1, 7))]
    plan = plan_retrieval(docs, cache, conversation_id=f"c{i % 13}",
                          ordering=rng.choice(["tree", "frequency"]),
                          dedupe=rng.choice(["drop", "mark", "off"]))
    out.append([[c.chunk_id for c in plan.chunks], plan.dropped_chunk_ids, plan.prefix_length])
    if i % 97 == 0 and plan.chunks:
        cache._forget_chunk(plan.chunks[-1].chunk_id)
json.dump(out, sys.stdout)
"""


@pytest.mark.slow
def test_orders_are_the_same_under_any_hash_seed() -> None:
    root = Path(__file__).resolve().parents[1]
    runs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", _WORKLOAD], env=env, cwd=root, capture_output=True, check=True
        )
        runs.append(json.loads(done.stdout))
    assert runs[0] == runs[1]

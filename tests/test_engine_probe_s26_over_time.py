"""What goes wrong with the engine only over time: many requests and conversation turns on
one engine, histories the app edits, a store evicting what a running request placed, streams
their reader abandons.  Tiny seeded float32 Llama; bytes are tensor storage sizes."""

from __future__ import annotations

import gc
import random
import weakref
from typing import Any

import pytest
import torch
from test_review_engine_memory import full_logits
from tiny_models import TOLERANCE, chunk, random_ids, text, tiny_lm

from chunkcache.core.engine import ChunkEngine, Prefilled, TokenSegment
from chunkcache.core.generation import GenerationRequest, Policy, SamplingParams
from chunkcache.core.kv_store import KVVariant, MemoryKVStore
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.segmenter import ChunkSegment, TextSegment

POLICIES: tuple[Policy, ...] = ("full", "prefix", "reuse", "cacheblend", "cachecraft")
SYSTEM = text(random_ids(5, 1))
A = chunk("a", random_ids(9, 2))
B = chunk("b", random_ids(7, 3))
QUESTION = text(random_ids(4, 4))


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def turn(
    engine: ChunkEngine, prompt: list[TokenSegment], policy: Policy, ratio: float = 0.15
) -> tuple[Prefilled, TokenSegment]:
    """One turn of conversation "c": prefill, 4 greedy tokens, remember; and its answer as
    the next prompt's text (the last token was sampled but never fed)."""
    out = engine.prefill(prompt, policy, ratio, conversation_id="c", reserve=4)
    answer = list(engine.decode(out, SamplingParams(max_tokens=4)))
    engine.remember("c", out)
    return out, text(answer[:-1])


def assert_adds_up(out: Prefilled, prompt: list[TokenSegment]) -> None:
    stats = out.stats
    assert stats.reused_tokens + stats.recomputed_tokens + stats.computed_tokens == len(out.ids)
    assert stats.chunk_hits + stats.chunk_misses == sum(p.is_chunk for p in prompt)


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages ``tensors`` keep alive."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


# The prefix policy promises exact KV; a conversation's past may hold blended KV.


def test_the_prefix_policy_stays_exact_after_a_blended_turn(lm: LoadedModel) -> None:
    engine = ChunkEngine(lm)
    engine.prefill([SYSTEM, B, A, QUESTION], "full")  # A cached after another context
    first, answer = turn(engine, [SYSTEM, A, QUESTION], "cacheblend", ratio=0.0)
    assert first.exact_until < len(first.ids)  # A was moved and kept as is: approximate
    prompt = [SYSTEM, A, QUESTION, answer, text(random_ids(3, 5))]
    second = engine.prefill(prompt, "prefix", conversation_id="c")
    assert second.stats.extra["prefix_tokens"] == len(SYSTEM.ids)  # the exact part only
    assert second.exact_until == len(second.ids)
    assert max_diff(second.logits, full_logits(lm, prompt)) < TOLERANCE


def test_a_blended_past_still_serves_the_reuse_policies(lm: LoadedModel) -> None:
    engine = ChunkEngine(lm)
    engine.prefill([SYSTEM, B, A, QUESTION], "full")
    first, answer = turn(engine, [SYSTEM, A, QUESTION], "cacheblend", ratio=0.0)
    second = engine.prefill([SYSTEM, A, QUESTION, answer, B], "reuse", conversation_id="c")
    assert second.stats.extra["prefix_tokens"] == len(first.ids)
    assert second.exact_until == first.exact_until


# An app that edits its history: the past is reused up to the first differing token.


def edited(prompt: list[TokenSegment], how: str) -> list[TokenSegment]:
    if how == "word":  # one word of the first question rewritten
        ids = list(QUESTION.ids)
        ids[2] = (ids[2] + 1) % 100 + 3
        return [SYSTEM, A, text(ids), *prompt[3:]]
    if how == "trimmed":  # the oldest message dropped
        return [SYSTEM, *prompt[2:]]
    return prompt[:3]  # regenerate: the first turn's prompt again


@pytest.mark.parametrize("policy", ["prefix", "reuse"])
@pytest.mark.parametrize("how", ["word", "trimmed", "regenerate"])
def test_an_edited_history_is_reused_up_to_its_first_difference(
    lm: LoadedModel, policy: Policy, how: str
) -> None:
    engine = ChunkEngine(lm)
    first, answer = turn(engine, [SYSTEM, A, QUESTION], policy)
    prompt = edited([SYSTEM, A, QUESTION, answer, B, text(random_ids(3, 6))], how)
    second = engine.prefill(prompt, policy, conversation_id="c")
    ids = [token for segment in prompt for token in segment.ids]
    pairs = enumerate(zip(ids, first.ids, strict=False))
    common = next((i for i, (x, y) in pairs if x != y), len(ids))
    assert second.stats.extra["prefix_tokens"] == min(common, len(ids) - 1)
    assert max_diff(second.logits, full_logits(lm, prompt)) < TOLERANCE


# Stats add up, and memory stays within its caps, over a long mixed run.


def test_stats_and_memory_add_up_over_a_long_mixed_run(lm: LoadedModel) -> None:
    rng = random.Random(0)
    pieces = [chunk(f"c{i}", random_ids(rng.randint(1, 9), 100 + i)) for i in range(6)]
    pieces += [text(random_ids(rng.randint(1, 4), 200 + i)) for i in range(3)]
    store = MemoryKVStore(capacity_bytes=40_000)  # a few prompts' worth: evicts all along
    engine = ChunkEngine(lm, store, max_conversations=3, max_conversation_tokens=100)
    s = lm.spec
    token_bytes = 2 * s.num_layers * s.num_kv_heads * s.head_dim * 4  # K and V, float32
    pasts: dict[str, list[TokenSegment]] = {}
    for _ in range(80):
        conversation = rng.choice([None, "a", "b", "c", "d"])
        new = [rng.choice(pieces) for _ in range(rng.randint(1, 5))]  # repeats some chunks
        past = pasts.get(conversation or "", [])
        prompt = [*past, *new] if sum(len(p.ids) for p in past) < 100 else new
        out = engine.prefill(
            prompt, rng.choice(POLICIES), rng.choice([0.0, 0.3]), conversation, reserve=3
        )
        assert_adds_up(out, prompt)
        answer = list(engine.decode(out, SamplingParams(max_tokens=3)))
        if conversation is not None:
            engine.remember(conversation, out)
            pasts[conversation] = [*prompt, text(answer[:-1])]
        held = [t for variant in store._entries.values() for t in (variant.k, variant.v)]
        assert storage_bytes(held) == store.num_bytes <= store.capacity_bytes
        remembered = engine.remembered()
        assert len(remembered) <= 3 and sum(remembered.values()) <= 100
        kept = [t for p in engine.conversations.pasts() for t in (p.kv.k, p.kv.v)]
        assert storage_bytes(kept) == sum(remembered.values()) * token_bytes
    assert store.num_evictions > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_chunk_twice_in_a_prompt_counts_twice_as_turns_repeat_and_the_store_evicts(
    lm: LoadedModel, policy: Policy
) -> None:
    store = MemoryKVStore()
    engine = ChunkEngine(lm, store)
    prompt = [SYSTEM, A, QUESTION, A, B]
    hits = []
    for evict in (False, False, True):
        if evict:  # between turns, the store drops everything
            filler = torch.zeros(1, 1, store.capacity_bytes // 32, 4)
            store.put(lm.fingerprint, KVVariant("filler", "root", 0, True, filler, filler))
        out = engine.prefill(prompt, policy, ratio=0.3)
        assert_adds_up(out, prompt)
        hits.append(out.stats.chunk_hits)
    assert hits == ([0, 0, 0] if policy == "full" else [0, 3, 0])


# The store evicts what a running request placed.


class EvictingStore(MemoryKVStore):
    """Evicts every entry (by putting one as large as its capacity) right after a request
    looked up the variants of ``evict_after``, as another thread's put would."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.evict_after: str | None = None
        self.placed: list[weakref.ref[Any]] = []

    def variants(self, fingerprint: str, segment_id: str) -> list[KVVariant]:
        found = super().variants(fingerprint, segment_id)
        self.placed += [weakref.ref(variant.k) for variant in found]
        if segment_id == self.evict_after:
            n = self.capacity_bytes // (2 * 4 * 4)  # float32 k and v of [1, 1, n, 4]
            filler = torch.zeros(1, 1, n, 4)
            super().put(fingerprint, KVVariant("filler", "root", 0, True, filler, filler.clone()))
        return found


@pytest.mark.parametrize("layer_loading", [False, True])
def test_variants_evicted_while_placed_serve_the_request_then_go(
    lm: LoadedModel, layer_loading: bool
) -> None:
    store = EvictingStore(capacity_bytes=200_000)
    engine = ChunkEngine(lm, store, layer_loading=layer_loading)
    engine.prefill([SYSTEM, A, B, QUESTION], "full")
    prompt = [QUESTION, B, A, SYSTEM]
    store.evict_after = A.segment_id  # the last chunk: every variant to place is chosen
    out = engine.prefill(prompt, "cacheblend", ratio=1.0, reserve=4)  # every reused row runs
    assert out.stats.chunk_hits == 2 and store.num_evictions >= 2
    list(engine.decode(out, SamplingParams(max_tokens=4)))
    assert max_diff(out.logits, full_logits(lm, prompt)) < TOLERANCE
    gc.collect()
    assert all(ref() is None for ref in store.placed)  # the evicted KV is not kept alive


# A stream its reader abandons releases its KV.


def test_an_abandoned_stream_releases_its_kv(lm: LoadedModel) -> None:
    kvs: list[weakref.ref[Any]] = []

    class Recording(ChunkEngine):
        def prefill(self, *args: Any, **kwargs: Any) -> Prefilled:
            out = super().prefill(*args, **kwargs)
            kvs.append(weakref.ref(out.kv.k))
            return out

    backend = LocalBackend(Recording(lm))
    request = GenerationRequest(
        [TextSegment("w1 w2 "), ChunkSegment("doc", "w5 w6 w7 " * 4), TextSegment("w4")],
        conversation_id="c",
        sampling=SamplingParams(max_tokens=40, temperature=1.0, seed=1),
    )
    stream = backend.stream(request)
    next(stream)
    gc.collect()
    assert kvs[0]() is not None  # read from: alive
    del stream  # never closed, never read again
    gc.collect()
    assert kvs[0]() is None and backend.engine.remembered() == {}
    pieces = list(backend.stream(request))  # the engine is free for the next request
    assert pieces[-1].stats is not None and pieces[-1].stats.completion_tokens == 40

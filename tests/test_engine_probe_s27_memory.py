"""The engine's memory of conversations, one sequence per prompt shape, over random turns.

Several conversations, each sending 2-3 prompt shapes, continue, edit or restart their
sequences, under every policy, with chunks in random orders and chunks whose first tokens
equal what a past holds next.  Over all of it: what the engine calls exact is exact, the
exact policies give full-prefill logits, stats add up, a chunk the store holds is placed
even where a past shares its first tokens, and the memory stays within its bounds holding
exactly the KV bytes it reports.  Tiny seeded float32 Llama; bytes are tensor storage sizes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from test_conversation_memory import past as fake_past
from test_engine_probe_s25_exact_claims import assert_exact_where_claimed
from test_engine_probe_s26_over_time import assert_adds_up, max_diff, storage_bytes, turn
from test_review_engine_memory import full_logits
from tiny_models import TOLERANCE, chunk, random_ids, text, tiny_lm

from chunkcache.core.conversation_memory import (
    SEQUENCES_PER_CONVERSATION,
    UNCONTINUED_PER_CONVERSATION,
    ConversationMemory,
)
from chunkcache.core.engine import ChunkEngine, Prefilled, TokenSegment
from chunkcache.core.generation import Policy, SamplingParams
from chunkcache.core.kv_store import MemoryKVStore, holds_segment
from chunkcache.core.models import LoadedModel

POLICIES: tuple[Policy, ...] = ("full", "prefix", "reuse", "cacheblend", "cachecraft")
PLACING: tuple[Policy, ...] = ("reuse", "cacheblend", "cachecraft")
PREFIXING: tuple[Policy, ...] = ("prefix", *PLACING)
RATIOS = (0.0, 0.15, 0.5, 1.0)
BLEND_ALL = ("cacheblend", 1.0)  # every reused row recomputed
CONVERSATIONS = ("x", "y", "z")


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


def tokens(segments: Sequence[TokenSegment]) -> list[int]:
    return [token for segment in segments for token in segment.ids]


def answered(
    engine: ChunkEngine, conversation: str, prompt: list[TokenSegment], out: Prefilled, n: int
) -> list[TokenSegment]:
    """Decode ``n`` greedy tokens, remember the turn: the sequence its shape continues (the
    last token was sampled but never fed)."""
    answer = list(engine.decode(out, SamplingParams(max_tokens=n)))
    engine.remember(conversation, out)
    return [*prompt, text(answer[:-1])] if len(answer) > 1 else prompt


# Random turns in conversations of several prompt shapes.


def echoed(
    rng: random.Random, engine: ChunkEngine, past: list[TokenSegment], step: int
) -> list[TokenSegment]:
    """``past`` up to a segment boundary, then a chunk whose first tokens are the ones the
    past holds next ("Fact 3"), which the store holds (computed after other text) most times."""
    cut = rng.randrange(1, len(past))
    shared = tokens(past[cut:])[: rng.randint(1, 4)]
    echo = chunk(f"echo{step}", [*shared, *random_ids(rng.randint(1, 5), 6000 + step)])
    if rng.random() < 0.8:
        engine.prefill([text(random_ids(2, 7000 + step)), echo], rng.choice(POLICIES))
    return [*past[:cut], echo]


def next_prompt(
    rng: random.Random,
    engine: ChunkEngine,
    chunks: list[TokenSegment],
    start: list[TokenSegment],
    past: list[TokenSegment] | None,
    step: int,
) -> list[TokenSegment]:
    """A shape's next prompt: its first prompt again, or its last sequence continued,
    edited (one segment replaced), or cut before an echoing chunk; then a few chunks in a
    random order and a question."""
    question = text(random_ids(rng.randint(1, 4), 5000 + step))
    new = [*rng.sample(chunks, rng.randint(0, 3)), question]
    roll = rng.random()
    if past is None or roll < 0.1:
        return [*start, *new]
    if roll < 0.3:
        edited = rng.randrange(len(past))
        return [*past[:edited], rng.choice([*chunks, question]), *past[edited + 1 :], *new]
    if roll < 0.6:
        return [*echoed(rng, engine, past, step), *new]
    return [*past, *new]


def assert_memory_within_bounds(lm: LoadedModel, engine: ChunkEngine) -> None:
    """Conversations, sequences per conversation (uncontinued ones too) and tokens within
    their bounds, and the reported tokens are the KV bytes the memory keeps alive."""
    remembered = engine.remembered()
    assert len(remembered) <= engine.max_conversations
    assert sum(remembered.values()) <= engine.max_conversation_tokens
    for kept in engine.conversations._conversations.values():
        assert 0 < len(kept) <= SEQUENCES_PER_CONVERSATION
        assert sum(not k.continued for k in kept) <= UNCONTINUED_PER_CONVERSATION
    pasts = list(engine.conversations.pasts())
    for past in pasts:
        assert len(past.ids) == past.kv.length == past.kv.capacity >= past.exact_until
    s = lm.spec
    token_bytes = 2 * s.num_layers * s.num_kv_heads * s.head_dim * 4  # K and V, float32
    held = [t for past in pasts for t in (past.kv.k, past.kv.v)]
    assert storage_bytes(held) == sum(remembered.values()) * token_bytes


def assert_pasts_exact_where_claimed(lm: LoadedModel, engine: ChunkEngine) -> None:
    """Every kept sequence, decoded tokens included, holds a full prefill's KV before its
    ``exact_until``."""
    for past in engine.conversations.pasts():
        reference = ChunkEngine(lm).prefill([text(past.ids)], "full").kv
        n = past.exact_until
        # past.kv.k, reference.k: [L, H_kv, S, D]
        assert torch.allclose(past.kv.k[:, :, :n], reference.k[:, :, :n], atol=TOLERANCE, rtol=0)
        assert torch.allclose(past.kv.v[:, :, :n], reference.v[:, :, :n], atol=TOLERANCE, rtol=0)


def run_random_turns(
    lm: LoadedModel,
    seed: int,
    steps: int,
    bounds: tuple[int, int, int] | None = None,
    exact_blend: bool = False,
) -> None:
    """``steps`` random requests on one engine, every claim checked after each; ``bounds``
    are (max conversations, max conversation tokens, store bytes), random when None; with
    ``exact_blend``, ``cacheblend`` at ratio 1.0 is held to full-prefill logits too."""
    rng = random.Random(seed)
    chunks = [chunk(f"c{i}", random_ids(rng.randint(1, 9), 100 + i)) for i in range(6)]
    if bounds is None:
        bounds = (rng.randint(1, 3), rng.choice([0, 30, 120, 10_000]), rng.choice([2**30, 60_000]))
    max_conversations, max_tokens, store_bytes = bounds
    store = MemoryKVStore(store_bytes)
    engine = ChunkEngine(lm, store, max_conversations, max_conversation_tokens=max_tokens)
    template = random_ids(rng.randint(1, 4), 900)  # every shape's first tokens
    starts = {
        c: [
            [text([*template, *random_ids(rng.randint(1, 6), 1000 + 10 * k + j)])] for j in range(3)
        ]
        for k, c in enumerate(CONVERSATIONS)
    }
    shapes = {c: rng.choice([2, 3]) for c in CONVERSATIONS}
    conversations = CONVERSATIONS[: rng.choice([2, 3])]
    lasts: dict[tuple[str, int], list[TokenSegment]] = {}
    for step in range(steps):
        conversation = rng.choice(conversations)
        shape = rng.randrange(shapes[conversation])
        past = lasts.get((conversation, shape))
        prompt = next_prompt(rng, engine, chunks, starts[conversation][shape], past, step)
        held = [holds_segment(store, lm.fingerprint, s.segment_id) for s in prompt]
        policy, ratio, n = rng.choice(POLICIES), rng.choice(RATIOS), rng.randint(1, 3)
        out = engine.prefill(prompt, policy, ratio, conversation, reserve=n)
        exact = policy in ("full", "prefix") or (exact_blend and (policy, ratio) == BLEND_ALL)
        if exact:  # whatever the memory holds; assert_exact_where_claimed then checks logits
            assert out.exact_until == len(out.ids)
        assert_exact_where_claimed(lm, out, prompt)
        assert_adds_up(out, prompt)
        if policy in PLACING:  # a held chunk is placed, even one a past covers in part
            unheld = sum(s.is_chunk and not h for s, h in zip(prompt, held, strict=True))
            assert out.stats.chunk_misses <= unheld
        lasts[(conversation, shape)] = answered(engine, conversation, prompt, out, n)
        assert_memory_within_bounds(lm, engine)
    assert_pasts_exact_where_claimed(lm, engine)


# (max conversations, max conversation tokens, store bytes): room for every sequence, or
# conversations and tokens evicted all along with a store that evicts too.  The seeds
# (of 10 tried) fill a conversation's 4 sequences, or hit the token bound, and cut a past
# before a stored chunk that it covers in part.
ROOMY, TIGHT = (2, 10_000, 2**30), (1, 90, 60_000)


@pytest.mark.parametrize("bounds", [ROOMY, TIGHT])
def test_random_turns_of_several_shapes_keep_every_claim(
    lm: LoadedModel, bounds: tuple[int, int, int]
) -> None:
    run_random_turns(lm, 4, 16, bounds)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10, 16))
def test_longer_random_runs_keep_every_claim(lm: LoadedModel, seed: int) -> None:
    run_random_turns(lm, seed, 40)


@pytest.mark.parametrize("seed", [10, 13])  # each meets a blended past under cacheblend 1.0
def test_random_turns_give_full_prefill_logits_under_cacheblend_at_ratio_one(
    lm: LoadedModel, seed: int
) -> None:
    run_random_turns(lm, seed, 40, exact_blend=True)


# The memory on its own: random keeps and matches of sequences sharing prefixes.


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


@pytest.mark.parametrize("seed", range(12))
def test_random_keeps_and_matches_respect_every_bound(seed: int) -> None:
    rng = random.Random(seed)
    memory = ConversationMemory(rng.randint(0, 3), rng.choice([0, 12, 40, 400]))
    sequences: list[list[int]] = [[1, 2, 3]]
    for _ in range(200):
        conversation = rng.choice("abcd")
        base = rng.choice(sequences)  # a prefix of an earlier sequence, then new tokens
        ids = [
            *base[: rng.randint(0, len(base))],
            *(rng.randrange(8) for _ in range(rng.randint(1, 9))),
        ]
        kept = list(memory._conversations.get(conversation, []))
        if rng.random() < 0.3:
            found, shared = memory.longest_match(conversation, ids)
            best = max((common_prefix(ids, k.past.ids) for k in kept), default=0)
            assert shared == best and (found is None) == (not kept)
            continue
        sequences.append(ids)
        new = fake_past(ids)
        memory.keep(conversation, new)
        pasts = [id(p) for p in memory.pasts()]
        extended = [k for k in kept if common_prefix(ids, k.past.ids) == len(k.past.ids)]
        assert all(id(k.past) not in pasts for k in extended)  # replaced, whatever the rule
        if len(ids) <= memory.max_tokens and memory.max_conversations > 0:
            assert memory.longest_match(conversation, ids) == (new, len(ids))
        lengths = memory.lengths()
        assert len(lengths) <= memory.max_conversations
        assert sum(lengths.values()) <= memory.max_tokens
        for held in memory._conversations.values():
            assert 0 < len(held) <= SEQUENCES_PER_CONVERSATION
            assert sum(not k.continued for k in held) <= UNCONTINUED_PER_CONVERSATION


# Prompt shapes alternating each turn, each extending its own last sequence.


def alternate_shapes(
    lm: LoadedModel,
    starts: list[list[TokenSegment]],
    policy: Policy,
    seed: int,
    conversations: tuple[str, ...] = ("c", "d"),
    most_chunks: int = 3,
    answer_tokens: tuple[int, int] = (1, 3),
    turns: int = 3,
) -> list[tuple[int, int]]:
    """``turns`` turns of ``conversations``, each sending every shape of ``starts`` each turn,
    each prompt its shape's last sequence plus up to ``most_chunks`` chunks in a random
    order and a question: per prompt from the second turn on, the prefix it reused and the
    length of its shape's last sequence."""
    rng = random.Random(seed)
    chunks = [chunk(f"c{i}", random_ids(rng.randint(1, 9), 100 + i)) for i in range(6)]
    ratio = rng.choice(RATIOS)
    engine = ChunkEngine(lm, max_conversations=len(conversations))
    lasts = {(c, j): start for c in conversations for j, start in enumerate(starts)}
    reused = []
    for step in range(turns * len(lasts)):
        key = list(lasts)[step % len(lasts)]
        question = text(random_ids(rng.randint(1, 4), 5000 + step))
        prompt = [*lasts[key], *rng.sample(chunks, rng.randint(0, most_chunks)), question]
        n = rng.randint(*answer_tokens)
        out = engine.prefill(prompt, policy, ratio, key[0], reserve=n)
        if step >= len(lasts):
            reused.append((out.stats.extra["prefix_tokens"], len(tokens(lasts[key]))))
        lasts[key] = answered(engine, key[0], prompt, out, n)
    return reused


@pytest.mark.parametrize(("seed", "policy"), list(enumerate(PREFIXING)))
def test_two_alternating_shapes_each_reuse_their_whole_last_sequence(
    lm: LoadedModel, seed: int, policy: Policy
) -> None:
    """The shapes share the chat template's first 1-3 tokens, less than half of either."""
    rng = random.Random(seed)
    template = random_ids(rng.randint(1, 3), 40)
    starts = [[text([*template, *random_ids(rng.randint(4, 6), 50 + j)])] for j in range(2)]
    for prefix, last in alternate_shapes(lm, starts, policy, seed):
        assert prefix >= last


def test_two_shapes_behind_one_long_system_prompt_each_reuse_their_whole_last_sequence(
    lm: LoadedModel,
) -> None:
    """A condense call and an answer call sharing the app's 12-token system prompt: the
    first shape's first sequence (12 + 3 + question + 3 answer tokens) shares most of
    itself with the second shape's, but not nearly all of its prompt: kept beside it."""
    system = random_ids(12, 41)
    starts = [[text([*system, *random_ids(3, 50 + j)])] for j in range(2)]
    reused = alternate_shapes(lm, starts, "prefix", 0, ("c",), 0, (4, 4), turns=2)
    assert all(prefix >= last for prefix, last in reused), reused


def test_three_alternating_shapes_each_reuse_their_whole_last_sequence(lm: LoadedModel) -> None:
    """A rephrasing, an answer, and an app's own step (a title, a follow-up suggestion):
    three first turns, all uncontinued, are kept until their next turns."""
    starts = [[text(random_ids(6, 50 + j))] for j in range(3)]
    reused = alternate_shapes(lm, starts, "prefix", 0, ("c",), 3, (4, 4), turns=2)
    assert all(prefix >= last for prefix, last in reused), reused


# A past left blended by a reuse policy, then cacheblend at ratio 1.0.

SYSTEM = text(random_ids(5, 1))
A = chunk("a", random_ids(9, 2))
B = chunk("b", random_ids(7, 3))
QUESTION = text(random_ids(4, 4))


@pytest.mark.parametrize("first_policy", PLACING)
def test_cacheblend_at_ratio_one_gives_full_prefill_logits_after_a_blended_turn(
    lm: LoadedModel, first_policy: Policy
) -> None:
    engine = ChunkEngine(lm)
    engine.prefill([SYSTEM, B, A, QUESTION], "full")  # A stored after another context
    first, answer = turn(engine, [SYSTEM, A, QUESTION], first_policy, ratio=0.0)
    assert first.exact_until == len(SYSTEM.ids)  # A was moved and kept as is
    prompt = [SYSTEM, A, QUESTION, answer, text(random_ids(3, 5))]
    second = engine.prefill(prompt, "cacheblend", ratio=1.0, conversation_id="c")
    assert max_diff(second.logits, full_logits(lm, prompt)) < TOLERANCE

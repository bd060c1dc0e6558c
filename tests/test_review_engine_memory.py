"""The engine's conversation memory is bounded in tokens, not only in conversations.

``ChunkEngine.remember`` keeps each conversation's last sequence so the next turn reuses
it as a prefix; ``max_conversation_tokens`` caps the KV tokens kept in all (least recently
used first out), a sequence over the cap is not kept (its next turn falls back to
the store, still exact), and what is kept is the used KV only, not the turn's buffer
sized for prompt + max_tokens.  Tiny seeded float32 models; token counts, never bytes.
"""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch
from tiny_models import TOLERANCE, chunk, random_ids, text, tiny_lm

from chunkcache.core.engine import ChunkEngine, Prefilled, TokenSegment
from chunkcache.core.generation import SamplingParams
from chunkcache.core.models import LoadedModel

ANSWER_TOKENS = 4  # decoded per turn; the last is sampled but never fed, so 3 get KV


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


def full_logits(lm: LoadedModel, segments: list[TokenSegment]) -> torch.Tensor:
    return ChunkEngine(lm).prefill(segments, "full").logits


def assert_exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert (actual - expected).abs().max().item() < TOLERANCE


def take_turn(
    engine: ChunkEngine, conversation_id: str, prompt: list[TokenSegment], reserve: int = 8
) -> tuple[Prefilled, TokenSegment]:
    """Prefill ``prompt``, decode, remember: the turn and its answer as the next prompt's text."""
    out = engine.prefill(prompt, "prefix", conversation_id=conversation_id, reserve=reserve)
    answer = list(engine.decode(out, SamplingParams(max_tokens=ANSWER_TOKENS)))
    engine.remember(conversation_id, out)
    return out, text(answer[:-1])


def test_the_total_stays_under_the_cap_across_many_conversations_and_turns(
    lm: LoadedModel,
) -> None:
    cap = 90
    engine = ChunkEngine(lm, max_conversation_tokens=cap)
    rng = random.Random(0)
    names = ["a", "b", "c"]
    prompts = {
        name: [text(random_ids(6, 1)), chunk(f"doc-{name}", random_ids(15, i + 2))]
        for i, name in enumerate(names)
    }
    evicted = oversize = 0
    for step in range(24):
        name = rng.choice(names)
        prompt = [*prompts[name], text(random_ids(5, 100 + step))]
        before = engine.remembered()
        out, answer = take_turn(engine, name, prompt)
        if name in before:  # the prompt extends the remembered sequence: reused whole
            assert out.stats.extra["prefix_tokens"] == before[name]
        assert_exact(out.logits, full_logits(lm, prompt))
        kept = engine.remembered()
        assert sum(kept.values()) <= cap
        if out.kv.length <= cap:
            assert list(kept)[-1] == name and kept[name] == out.kv.length
        else:
            assert name not in kept
            oversize += 1
        evicted += len([n for n in before if n != name and n not in kept])
        prompts[name] = [*prompt, answer]
    assert evicted and oversize  # both limits were met along the way


def test_the_least_recently_used_conversation_goes_first(lm: LoadedModel) -> None:
    engine = ChunkEngine(lm, max_conversation_tokens=55)
    prompts = {name: [text(random_ids(20, seed))] for seed, name in enumerate("abc", start=30)}
    _, answer_a = take_turn(engine, "a", prompts["a"])  # 23 tokens
    _, answer_b = take_turn(engine, "b", prompts["b"])  # 23
    a2 = [*prompts["a"], answer_a, text(random_ids(4, 40))]
    _, answer_a2 = take_turn(engine, "a", a2)  # 30: a is now the most recent
    assert engine.remembered() == {"b": 23, "a": 30}
    take_turn(engine, "c", prompts["c"])  # 23 more: over 55, b (not a) is forgotten
    assert engine.remembered() == {"a": 30, "c": 23}

    a3 = [*a2, answer_a2, text(random_ids(4, 42))]
    out = engine.prefill(a3, "prefix", conversation_id="a")
    assert out.stats.extra["prefix_tokens"] == 30  # its whole last sequence, remembered
    assert_exact(out.logits, full_logits(lm, a3))
    assert list(engine.remembered()) == ["c", "a"]  # reading it was a use
    b2 = [*prompts["b"], answer_b, text(random_ids(4, 41))]
    out = engine.prefill(b2, "prefix", conversation_id="b")
    assert out.stats.extra["prefix_tokens"] == 20  # its prompt, from the store
    assert_exact(out.logits, full_logits(lm, b2))


def test_a_conversation_over_the_cap_is_not_remembered_and_stays_exact(
    lm: LoadedModel,
) -> None:
    engine = ChunkEngine(lm, max_conversation_tokens=30)
    take_turn(engine, "small", [text(random_ids(2, 50))])  # 5 tokens
    first = [text(random_ids(20, 51))]
    _, answer = take_turn(engine, "c", first)  # 23 tokens: remembered
    assert engine.remembered() == {"small": 5, "c": 23}
    second = [*first, answer, text(random_ids(10, 52))]
    out, answer = take_turn(engine, "c", second)  # 36 tokens: over the cap on its own
    assert out.kv.length == 36
    assert engine.remembered() == {"small": 5}  # its older sequence dropped, no other

    third = [*second, answer, text(random_ids(3, 53))]
    out = engine.prefill(third, "prefix", conversation_id="c")
    assert out.stats.extra["prefix_tokens"] == 33  # the second prompt, from the store
    assert_exact(out.logits, full_logits(lm, third))


def test_a_remembered_turn_keeps_only_its_used_kv_and_is_reused_exactly(
    lm: LoadedModel,
) -> None:
    """The turn's KV buffer has room for prompt + max_tokens: the engine keeps a copy of
    the slots in use and lets the buffer go."""
    engine = ChunkEngine(lm)
    prompt = [text(random_ids(9, 60)), chunk("doc", random_ids(17, 61)), text(random_ids(7, 62))]
    first, answer = take_turn(engine, "c", prompt, reserve=64)
    length = first.kv.length
    assert first.kv.capacity == length + 64 - (ANSWER_TOKENS - 1)
    buffer = weakref.ref(first.kv.k)
    del first
    gc.collect()
    assert buffer() is None
    assert engine.remembered() == {"c": length}

    turn = [*prompt, answer, text(random_ids(6, 63))]
    out = engine.prefill(turn, "prefix", conversation_id="c")
    assert out.stats.extra["prefix_tokens"] == length
    assert_exact(out.logits, full_logits(lm, turn))


def test_a_cap_of_zero_remembers_nothing(lm: LoadedModel) -> None:
    engine = ChunkEngine(lm, max_conversation_tokens=0)
    take_turn(engine, "c", [text(random_ids(5, 70))])
    assert engine.remembered() == {}


@pytest.mark.parametrize(
    "limits",
    [
        {"max_conversation_tokens": -1},
        {"max_conversation_tokens": 1.5},
        {"max_conversation_tokens": True},
        {"max_conversations": -1},
    ],
)
def test_bad_limits_are_refused(lm: LoadedModel, limits: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must be an int >= 0"):
        ChunkEngine(lm, **limits)  # type: ignore[arg-type]

"""The engine's hard gate: every exact path reproduces full prefill (float32, tiny models).

``cacheblend`` at ratio 1.0, ``prefix``, and ``reuse`` of a chunk in its
original context must give the logits of a ``full`` prefill (max-abs < 1e-4);
partial ratios must stay finite and count their tokens consistently.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import TOLERANCE, chunk, random_ids, text, tiny_hf_model, tiny_lm, tiny_tokenizer

from chunkcache.core.engine import ChunkEngine, Prefilled, PromptTooLongError, TokenSegment
from chunkcache.core.generation import Policy, SamplingParams
from chunkcache.core.models import LoadedModel

SYSTEM = text(random_ids(9, 1))
A, B, C = (chunk(name, random_ids(17, seed)) for seed, name in enumerate("abc", start=2))
QUESTION = text(random_ids(7, 9))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lm(request: pytest.FixtureRequest) -> LoadedModel:
    return tiny_lm(request.param)


def full_logits(lm: LoadedModel, segments: list[TokenSegment]) -> torch.Tensor:
    return ChunkEngine(lm).prefill(segments, "full").logits


def assert_exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert (actual - expected).abs().max().item() < TOLERANCE


def test_full_matches_hugging_face(lm: LoadedModel) -> None:
    segments = [SYSTEM, A, B, QUESTION]
    ids = torch.tensor([t for s in segments for t in s.ids])
    expected = lm.hf(ids[None]).logits[0, -1].float()
    assert_exact(full_logits(lm, segments), expected)


def test_prefix_reuse_is_exact(lm: LoadedModel) -> None:
    engine = ChunkEngine(lm)
    engine.prefill([SYSTEM, A, B, QUESTION], "full")
    request = [SYSTEM, A, B, C, QUESTION]
    out = engine.prefill(request, "prefix")
    assert out.stats.reused_tokens == len(SYSTEM.ids) + len(A.ids) + len(B.ids)
    assert_exact(out.logits, full_logits(lm, request))


@pytest.mark.parametrize("policy", ["prefix", "reuse", "cacheblend"])
def test_a_prompt_ending_in_a_cached_chunk_counts_it_a_hit(lm: LoadedModel, policy: str) -> None:
    engine = ChunkEngine(lm)
    engine.prefill([SYSTEM, A, B], "full")
    out = engine.prefill([SYSTEM, A, B], policy)  # type: ignore[arg-type]
    assert (out.stats.chunk_hits, out.stats.chunk_misses) == (2, 0)
    assert out.stats.reused_tokens == out.stats.prompt_tokens - 1  # the last token runs
    assert_exact(out.logits, full_logits(lm, [SYSTEM, A, B]))


def test_reuse_in_the_original_context_is_exact(lm: LoadedModel) -> None:
    engine = ChunkEngine(lm)
    engine.prefill([SYSTEM, A, B, QUESTION], "full")
    other_question = text(random_ids(5, 11))
    request = [SYSTEM, A, B, other_question]
    out = engine.prefill(request, "reuse")
    assert out.stats.chunk_hits == 2
    assert_exact(out.logits, full_logits(lm, request))


def test_cacheblend_at_ratio_one_equals_full_prefill(lm: LoadedModel) -> None:
    engine = ChunkEngine(lm)
    engine.prefill([A, QUESTION], "full")
    engine.prefill([B, QUESTION], "full")
    request = [SYSTEM, B, A, QUESTION]  # both chunks cached, at other positions
    out = engine.prefill(request, "cacheblend", ratio=1.0)
    assert out.stats.recomputed_tokens == len(A.ids) + len(B.ids)
    assert_exact(out.logits, full_logits(lm, request))


@pytest.mark.parametrize("policy", ["reuse", "cacheblend"])
def test_moved_chunks_are_reused_and_counted(lm: LoadedModel, policy: str) -> None:
    engine = ChunkEngine(lm)
    engine.prefill([SYSTEM, A, QUESTION], "full")
    engine.prefill([SYSTEM, B, QUESTION], "full")
    request = [SYSTEM, B, A, C, QUESTION]
    out = engine.prefill(request, policy, ratio=0.3)  # type: ignore[arg-type]
    stats = out.stats
    assert (stats.chunk_hits, stats.chunk_misses) == (2, 1)
    total = stats.reused_tokens + stats.recomputed_tokens + stats.computed_tokens
    assert total == stats.prompt_tokens
    assert torch.isfinite(out.logits).all()
    if policy == "reuse":
        assert stats.recomputed_tokens == 0
    else:
        assert 0 < stats.recomputed_tokens < len(A.ids) + len(B.ids)


def test_blended_kv_is_never_served_as_an_exact_prefix(lm: LoadedModel) -> None:
    engine = ChunkEngine(lm)
    engine.prefill([SYSTEM, A, QUESTION], "full")
    blended = [SYSTEM, B, A, C, QUESTION]
    engine.prefill([SYSTEM, B, QUESTION], "full")
    engine.prefill(blended, "cacheblend", ratio=0.2)
    again = engine.prefill(blended, "prefix")
    # SYSTEM and B were exact; A (moved) and C (after blended KV) must be recomputed.
    assert again.stats.reused_tokens == len(SYSTEM.ids) + len(B.ids)
    assert_exact(again.logits, full_logits(lm, blended))


def test_conversation_turns_reuse_the_previous_sequence(lm: LoadedModel) -> None:
    engine = ChunkEngine(lm)
    turn1 = [SYSTEM, A, QUESTION]
    first = engine.prefill(turn1, "prefix", conversation_id="c")
    answer = list(engine.decode(first, SamplingParams(max_tokens=4)))
    engine.remember("c", first)
    turn2 = [*turn1, text(answer[:-1]), B, text(random_ids(6, 12))]
    second = engine.prefill(turn2, "prefix", conversation_id="c")
    assert second.stats.extra["prefix_tokens"] == len(first.ids)
    assert_exact(second.logits, full_logits(lm, turn2))


def test_prompt_over_the_context_window_is_refused(lm: LoadedModel) -> None:
    too_long = text([5] * (lm.spec.max_positions + 1))
    with pytest.raises(PromptTooLongError):
        ChunkEngine(lm).prefill([too_long], "full")


def test_greedy_decoding_matches_hugging_face_generate(lm: LoadedModel) -> None:
    segments = [SYSTEM, A, QUESTION]
    engine = ChunkEngine(lm)
    prefilled = engine.prefill(segments, "full", reserve=6)
    ours = list(engine.decode(prefilled, SamplingParams(max_tokens=6)))
    ids = torch.tensor([[t for s in segments for t in s.ids]])
    theirs = lm.hf.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert ours == theirs[0, ids.shape[1] :].tolist()


def answer(engine: ChunkEngine, prefilled: Prefilled, tokens: int = 4) -> TokenSegment:
    """``tokens`` greedy tokens after ``prefilled``, as the text of the next turn's prompt
    (the last one was sampled but never fed)."""
    ids = list(engine.decode(prefilled, SamplingParams(max_tokens=tokens)))
    return text(tuple(ids[:-1]))


def test_a_conversation_stays_exact_from_turn_to_turn(lm: LoadedModel) -> None:
    """Decoded tokens extend the exact KV, so the next turn's new segments are stored
    as exact variants (the store can then serve them as a prefix)."""
    engine = ChunkEngine(lm)
    first = engine.prefill([SYSTEM, A, QUESTION], "prefix", conversation_id="c", reserve=4)
    turn = [SYSTEM, A, QUESTION, answer(engine, first), B, text(random_ids(6, 12))]
    engine.remember("c", first)
    second = engine.prefill(turn, "prefix", conversation_id="c")
    assert second.exact_until == len(second.ids)
    assert engine.store.exact(lm.fingerprint, B.segment_id, contexts_of(turn)[4]) is not None
    assert_exact(second.logits, full_logits(lm, turn))


@pytest.mark.parametrize("policy", ["prefix", "reuse", "cacheblend"])
def test_a_forgotten_conversation_is_found_whole_in_the_store(
    lm: LoadedModel, policy: Policy
) -> None:
    engine = ChunkEngine(lm, max_conversations=1)
    first = engine.prefill([SYSTEM, A, QUESTION], "prefix", conversation_id="c", reserve=4)
    turn = [SYSTEM, A, QUESTION, answer(engine, first), B, text(random_ids(6, 12))]
    engine.remember("c", first)
    engine.prefill(turn, "prefix", conversation_id="c")
    engine.remember("other", first)  # "c" is forgotten
    out = engine.prefill([*turn, text(random_ids(5, 13))], policy, conversation_id="c")
    assert out.stats.extra["prefix_tokens"] == sum(len(s.ids) for s in turn)
    assert_exact(out.logits, full_logits(lm, [*turn, text(random_ids(5, 13))]))


def test_a_chunk_is_placed_from_the_variant_of_its_own_context(lm: LoadedModel) -> None:
    """Not the most recent variant: the one computed after exactly this prompt's tokens."""
    engine = ChunkEngine(lm)
    engine.prefill([C, QUESTION], "full")  # C cached elsewhere: placed, so approximate
    request = [SYSTEM, C, text(random_ids(4, 14)), B, QUESTION]
    first = engine.prefill(request, "reuse")  # B computed after approximate KV: stored
    engine.prefill([text(random_ids(3, 15)), B, QUESTION], "full")  # a newer variant of B
    again = engine.prefill(request, "reuse")
    assert again.stats.chunk_hits == 2
    assert_exact(again.logits, first.logits)


def test_a_prompt_past_the_sliding_window_is_refused_by_every_policy() -> None:
    """The engine's attention is full: past a sliding window it would not compute what
    the model does, whichever layers a policy runs."""
    lm = LoadedModel.from_hf(tiny_hf_model("mistral", sliding_window=16), tiny_tokenizer())
    assert lm.spec.context_window == 16
    short = chunk("short", random_ids(10, 2))
    for policy in ("full", "prefix", "reuse", "cacheblend", "cachecraft"):
        engine = ChunkEngine(lm)
        engine.prefill([short, text((5,))], "full")  # cached: the policies place it
        with pytest.raises(PromptTooLongError, match="context window of 16"):
            engine.prefill([SYSTEM, short], policy)


def contexts_of(segments: list[TokenSegment]) -> list[str]:
    from chunkcache.core.engine import _layout

    return _layout(segments)[1]


def test_decoding_stops_at_the_context_window(lm: LoadedModel) -> None:
    window = lm.spec.context_window
    prompt = text(random_ids(window - 3, 21))
    engine = ChunkEngine(lm)
    prefilled = engine.prefill([prompt], "full")  # no room reserved
    tokens = list(engine.decode(prefilled, SamplingParams(max_tokens=10)))
    assert len(tokens) == 4 and prefilled.kv.length == window  # 3 fed, the 4th sampled

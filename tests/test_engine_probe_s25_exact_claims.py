"""What the engine calls exact is exact, over random request sequences on one engine.

Chunks of one token and more, repeated, moved, under every policy and ratio, in conversations
whose history is sometimes edited: every slot before ``Prefilled.exact_until`` must hold the KV
a full prefill computes, and a prefill claiming the whole prompt exact must give its logits.
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import TOLERANCE, chunk, random_ids, text, tiny_lm

from chunkcache.core.engine import ChunkEngine, Prefilled, TokenSegment
from chunkcache.core.generation import Policy, SamplingParams
from chunkcache.core.models import LoadedModel

POLICIES: tuple[Policy, ...] = ("full", "prefix", "reuse", "cacheblend", "cachecraft")


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


def assert_exact_where_claimed(
    lm: LoadedModel, prefilled: Prefilled, segments: list[TokenSegment]
) -> None:
    reference = ChunkEngine(lm).prefill(segments, "full")
    until = prefilled.exact_until
    for ours, theirs in ((prefilled.kv.k, reference.kv.k), (prefilled.kv.v, reference.kv.v)):
        # ours, theirs: [L, H_kv, S, D]
        assert torch.allclose(ours[:, :, :until], theirs[:, :, :until], atol=TOLERANCE, rtol=0)
    if until == len(prefilled.ids):
        assert torch.allclose(prefilled.logits, reference.logits, atol=TOLERANCE, rtol=0)


def next_prompt(
    rng: random.Random, pieces: list[TokenSegment], past: list[TokenSegment] | None
) -> list[TokenSegment]:
    """A few random pieces, after the conversation's past (sometimes with one piece edited)."""
    new = [rng.choice(pieces) for _ in range(rng.randint(1, 4))]
    if past is None or rng.random() < 0.3 or sum(len(s.ids) for s in past) > 120:
        return new
    if len(past) > 1 and rng.random() < 0.3:
        edited = rng.randrange(len(past))
        past = [*past[:edited], rng.choice(pieces), *past[edited + 1 :]]
    return [*past, *new]


@pytest.mark.parametrize("seed", range(4))
def test_exact_until_holds_over_random_request_sequences(lm: LoadedModel, seed: int) -> None:
    rng = random.Random(seed)
    chunks = [chunk(f"c{i}", random_ids(rng.randint(1, 9), 100 + i)) for i in range(4)]
    texts = [text(random_ids(rng.randint(1, 4), 200 + i)) for i in range(3)]
    engine = ChunkEngine(lm, max_conversations=2, max_conversation_tokens=80)
    pasts: dict[str, list[TokenSegment]] = {}
    for _ in range(16):
        conversation = rng.choice([None, "a", "b"])
        past = pasts.get(conversation) if conversation else None
        segments = next_prompt(rng, chunks + texts, past)
        max_tokens = rng.randint(1, 3)
        policy, ratio = rng.choice(POLICIES), rng.choice([0.0, 0.15, 0.5, 1.0])
        prefilled = engine.prefill(segments, policy, ratio, conversation, reserve=max_tokens)
        assert_exact_where_claimed(lm, prefilled, segments)
        answer = list(engine.decode(prefilled, SamplingParams(max_tokens=max_tokens)))
        if conversation is not None:
            engine.remember(conversation, prefilled)
            fed = [text(answer[:-1])] if len(answer) > 1 else []
            pasts[conversation] = [*segments, *fed]

"""The engine's memory of conversations: one sequence per prompt shape, each replaced by
the next prompt that continues it, and every bound (conversations, sequences, tokens)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TOLERANCE, chunk, random_ids, text, tiny_lm

from chunkcache.core.conversation_memory import (
    SEQUENCES_PER_CONVERSATION,
    ConversationMemory,
    Past,
)
from chunkcache.core.engine import ChunkEngine, TokenSegment
from chunkcache.core.models import LoadedModel
from chunkcache.kernels.kv import SeqKV


def past(ids: list[int], answer: int = 0) -> Past:
    """A kept sequence of ``ids``, its last ``answer`` tokens the answer (no real KV)."""
    n = len(ids)
    kv = SeqKV(torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1), n)
    return Past(tuple(ids), kv, n, n - answer)


ANSWER = list(range(100, 140))  # an answer prompt's shape
REPHRASE = [100, 101, 102, *range(300, 330)]  # shares the template's first 3 tokens


def test_two_prompt_shapes_in_one_conversation_keep_a_sequence_each() -> None:
    memory = ConversationMemory(max_conversations=4, max_tokens=10_000)
    memory.keep("c", past(ANSWER))
    memory.keep("c", past(REPHRASE))
    memory.keep("c", past([*ANSWER, *range(500, 510)]))  # the next turn's answer continues it
    assert memory.lengths() == {"c": len(REPHRASE) + len(ANSWER) + 10}
    found, shared = memory.longest_match("c", [*REPHRASE, 7, 8])
    assert found is not None and found.ids == tuple(REPHRASE) and shared == len(REPHRASE)
    found, shared = memory.longest_match("c", [*ANSWER, 1])
    assert found is not None and len(found.ids) == len(ANSWER) + 10 and shared == len(ANSWER)


def test_a_next_turn_that_rewrites_the_answers_tail_still_replaces_it() -> None:
    memory = ConversationMemory(max_conversations=4, max_tokens=10_000)
    memory.keep("c", past(ANSWER, answer=5))
    memory.keep("c", past([*ANSWER[:-5], 1, 2, 3, 4, 5, 6]))  # re-rendered answer, then more
    assert memory.lengths() == {"c": len(ANSWER) + 1}


def test_a_conversation_keeps_at_most_its_sequences_least_recently_used_out() -> None:
    memory = ConversationMemory(max_conversations=4, max_tokens=10_000)
    for shape in range(6):  # six shapes, each sent again the next turn
        first_turn = [shape, *range(1000 * shape, 1000 * shape + 20)]
        memory.keep("c", past(first_turn))
        memory.keep("c", past([*first_turn, 7]))
    kept = {p.ids[0] for p in memory.pasts()}
    assert kept == set(range(6 - SEQUENCES_PER_CONVERSATION, 6))


def test_tokens_and_conversations_are_bounded_least_recently_used_first() -> None:
    memory = ConversationMemory(max_conversations=2, max_tokens=100)
    memory.keep("a", past(list(range(40))))
    memory.keep("b", past(list(range(50, 90))))
    memory.longest_match("a", [0, 1])  # a use: "b" is now the least recently used
    memory.keep("c", past(list(range(200, 230))))
    assert list(memory.lengths()) == ["a", "c"]
    memory.keep("a", past([500, *range(60)]))  # a second shape of "a": 101 tokens in all
    # "c" goes first, then the older sequence of "a", not all of "a"
    assert memory.lengths() == {"a": 61}
    assert [p.ids[0] for p in memory.pasts()] == [500]


def test_a_sequence_over_the_token_bound_is_not_kept_and_drops_the_one_it_continues() -> None:
    memory = ConversationMemory(max_conversations=4, max_tokens=50)
    memory.keep("c", past(list(range(40))))
    memory.keep("c", past(list(range(60))))
    assert memory.lengths() == {}
    assert memory.longest_match("c", [0]) == (None, 0)


# The engine: a conversation's past that starts like a stored chunk.

SYSTEM = text(random_ids(9, 1))
B = chunk("b", random_ids(17, 3))
QUESTION = text(random_ids(7, 9))


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


def engine_with_past(lm: LoadedModel) -> ChunkEngine:
    """Chunk B stored after other text; conversation "c" last sent the system prompt and
    text that starts with B's first three tokens."""
    engine = ChunkEngine(lm)
    engine.prefill([text(random_ids(5, 30)), B], "full")
    turn = engine.prefill([SYSTEM, text([*B.ids[:3], *random_ids(6, 31)])], "full")
    engine.remember("c", turn)
    return engine


def test_a_past_that_starts_like_a_stored_chunk_stops_before_it_so_it_is_placed(
    lm: LoadedModel,
) -> None:
    segments: list[TokenSegment] = [SYSTEM, B, QUESTION]
    out = engine_with_past(lm).prefill(segments, "reuse", conversation_id="c")
    assert out.stats.extra["prefix_tokens"] == len(SYSTEM.ids)
    assert (out.stats.chunk_hits, out.stats.chunk_misses) == (1, 0)
    assert out.stats.computed_tokens == len(QUESTION.ids)


def test_the_stopped_prefix_stays_exact_and_prefix_keeps_every_exact_token(
    lm: LoadedModel,
) -> None:
    segments: list[TokenSegment] = [SYSTEM, B, QUESTION]
    full = ChunkEngine(lm).prefill(segments, "full").logits
    engine = engine_with_past(lm)
    blended = engine.prefill(segments, "cacheblend", ratio=1.0, conversation_id="c")
    assert (blended.logits - full).abs().max().item() < TOLERANCE
    exact = engine_with_past(lm).prefill(segments, "prefix", conversation_id="c")
    assert exact.stats.extra["prefix_tokens"] == len(SYSTEM.ids) + 3  # nothing is placed
    assert (exact.logits - full).abs().max().item() < TOLERANCE


def test_prompts_that_start_anew_every_turn_keep_three_sequences_not_four() -> None:
    """LlamaIndex's ContextChatEngine rewrites the system message each turn: no prompt
    continues the last, so only the three most recent are kept."""
    memory = ConversationMemory(max_conversations=4, max_tokens=10_000)
    for turn in range(5):
        memory.keep("c", past([1, 2, 3, *range(100 * turn + 10, 100 * turn + 40)]))
    assert [p.ids[3] for p in memory.pasts()] == [210, 310, 410]


def test_a_second_shape_and_its_next_turn_keep_both_while_new_prompts_come_and_go() -> None:
    memory = ConversationMemory(max_conversations=4, max_tokens=10_000)
    memory.keep("c", past(ANSWER))
    memory.keep("c", past(REPHRASE))
    memory.keep("c", past([*ANSWER, 7]))  # continued: a shape the app sends again
    memory.keep("c", past([*REPHRASE, 7]))
    for turn in range(3):  # one-off prompts take only the uncontinued places
        memory.keep("c", past([100, 101, *range(1000 * turn + 500, 1000 * turn + 530)]))
    firsts = sorted(p.ids[2] for p in memory.pasts())
    assert len(firsts) == 4 and {102} <= set(firsts)  # both shapes kept
    assert sorted(len(p.ids) for p in memory.pasts())[-2:] == sorted(
        [len(ANSWER) + 1, len(REPHRASE) + 1]
    )

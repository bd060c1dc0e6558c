"""The synthetic request stream: seeded, well-formed conversations, the templates asked for."""

from __future__ import annotations

import pytest

from chunkcache.core.corpus import CorpusChunk
from chunkcache.core.workload import (
    QUOTE_QUESTIONS,
    TITLE_QUESTIONS,
    WorkloadConfig,
    multi_turn_trace,
)


def _chunk(topic: str, number: int) -> CorpusChunk:
    title = f"{topic}.function_{number}"
    body = " ".join(f"word{number}_{i}" for i in range(30))
    return CorpusChunk(f"{topic}-{number}", f"{title}\n{body}", topic, title, "test")


CORPUS = [_chunk(topic, n) for topic in ("json", "os", "re", "csv") for n in range(6)]


def test_same_seed_same_stream_other_seed_other_stream():
    config = WorkloadConfig(num_conversations=20, seed=5)
    assert multi_turn_trace(CORPUS, config) == multi_turn_trace(CORPUS, config)
    other = multi_turn_trace(CORPUS, WorkloadConfig(num_conversations=20, seed=6))
    assert other != multi_turn_trace(CORPUS, config)


def test_conversations_have_their_turns_in_order_and_arrive_sorted():
    config = WorkloadConfig(num_conversations=30, min_turns=2, max_turns=4, seed=1)
    turns = multi_turn_trace(CORPUS, config)
    arrivals = [turn.arrival_s for turn in turns]
    assert arrivals == sorted(arrivals)
    by_conversation: dict[str, list[int]] = {}
    for turn in turns:
        by_conversation.setdefault(turn.conversation_id, []).append(turn.turn_index)
    assert len(by_conversation) == 30
    for indices in by_conversation.values():
        assert indices == list(range(len(indices)))
        assert 2 <= len(indices) <= 4
    assert {turn.topic for turn in turns} <= {chunk.topic for chunk in CORPUS}


def test_title_questions_name_a_chunk_and_quote_nothing():
    config = WorkloadConfig(num_conversations=15, seed=2, templates=TITLE_QUESTIONS)
    titles = {chunk.title for chunk in CORPUS}
    for turn in multi_turn_trace(CORPUS, config):
        assert any(title in turn.question for title in titles)
        assert "word" not in turn.question


def test_quote_questions_quote_the_chunk_body():
    config = WorkloadConfig(num_conversations=15, seed=2, templates=QUOTE_QUESTIONS)
    for turn in multi_turn_trace(CORPUS, config):
        assert "word" in turn.question


@pytest.mark.parametrize(
    "config",
    [
        WorkloadConfig(min_turns=0),
        WorkloadConfig(min_turns=3, max_turns=2),
        WorkloadConfig(templates=()),
    ],
)
def test_bad_config_is_refused(config):
    with pytest.raises(ValueError):
        multi_turn_trace(CORPUS, config)


def test_an_empty_corpus_is_refused():
    with pytest.raises(ValueError, match="no chunks"):
        multi_turn_trace([], WorkloadConfig())

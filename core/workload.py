"""Synthetic but realistic RAG request streams over a corpus of topic-tagged chunks.

Topics are drawn with Zipf popularity; each conversation asks 2-5 questions
built from templates over chunks of its topic, with follow-ups that mostly stay
on the topic and sometimes move to a neighbouring one.  Conversations overlap in
time (Poisson starts, think time between turns), so the stream interleaves them
the way a server sees them.  A seed makes every stream repeatable.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from chunkcache.core.corpus import CorpusChunk, topics

# Questions about a chunk by its title only: what a reader of the demo can follow.
TITLE_QUESTIONS = (
    "What does {title} do?",
    "How do I use {title}?",
    "Explain {title} with an example.",
    "What arguments does {title} take?",
    "When should I use {title}?",
)
# Questions quoting a few words of the chunk (:func:`random_phrase`).
QUOTE_QUESTIONS = (
    "In {topic}, what does it mean that {phrase}?",
    "Why does {title} say {phrase}?",
    "{phrase}: how does that work in {topic}?",
)
QUESTION_TEMPLATES = TITLE_QUESTIONS + QUOTE_QUESTIONS


@dataclass(frozen=True)
class Turn:
    """One request: a question in a conversation, at a time (seconds from the start)."""

    conversation_id: str
    turn_index: int
    question: str
    topic: str
    arrival_s: float


@dataclass(frozen=True)
class WorkloadConfig:
    """Knobs of a multi-turn stream; ``min_turns = max_turns = 1`` gives single-turn."""

    num_conversations: int = 200
    min_turns: int = 2
    max_turns: int = 5
    topic_zipf_s: float = 1.1
    chunk_zipf_s: float = 1.1
    same_topic_probability: float = 0.7
    conversations_per_s: float = 2.0
    think_time_s: float = 5.0
    seed: int = 0
    templates: tuple[str, ...] = QUESTION_TEMPLATES  # str.format with title, topic, phrase


def zipf_weights(n: int, s: float) -> list[float]:
    """Unnormalised Zipf weights ``1 / rank**s`` for ranks 1..n."""
    return [1.0 / (rank**s) for rank in range(1, n + 1)]


def random_phrase(chunk: CorpusChunk, rng: random.Random, num_words: int = 5) -> str:
    """A few consecutive words of the chunk body: users quote what they half remember,
    so questions on one chunk differ and retrieve overlapping, reordered sets."""
    words = chunk.text.split("\n", 1)[-1].split()
    if len(words) <= num_words:
        return " ".join(words) or chunk.title
    start = rng.randrange(len(words) - num_words)
    return " ".join(words[start : start + num_words])


def multi_turn_trace(chunks: Sequence[CorpusChunk], config: WorkloadConfig) -> list[Turn]:
    """Turns of ``config.num_conversations`` conversations, sorted by arrival time."""
    if not 1 <= config.min_turns <= config.max_turns:
        raise ValueError("need 1 <= min_turns <= max_turns")
    if not config.templates:
        raise ValueError("need at least one question template")
    rng = random.Random(config.seed)
    by_topic = topics(chunks)
    if not by_topic:
        raise ValueError("the corpus has no chunks")
    ranked_topics = sorted(by_topic)
    rng.shuffle(ranked_topics)  # popularity rank is independent of the name
    topic_weights = zipf_weights(len(ranked_topics), config.topic_zipf_s)
    turns: list[Turn] = []
    start = 0.0
    for number in range(config.num_conversations):
        start += rng.expovariate(config.conversations_per_s)
        rank = rng.choices(range(len(ranked_topics)), weights=topic_weights)[0]
        arrival = start
        for turn_index in range(rng.randint(config.min_turns, config.max_turns)):
            if turn_index and rng.random() > config.same_topic_probability:
                rank = min(max(rank + rng.choice((-1, 1)), 0), len(ranked_topics) - 1)
            topic = ranked_topics[rank]
            candidates = by_topic[topic]
            weights = zipf_weights(len(candidates), config.chunk_zipf_s)
            chunk = rng.choices(candidates, weights=weights)[0]
            question = rng.choice(config.templates).format(
                title=chunk.title, topic=topic, phrase=random_phrase(chunk, rng)
            )
            turns.append(Turn(f"conv-{number:05d}", turn_index, question, topic, arrival))
            arrival += rng.expovariate(1.0 / config.think_time_s)
    turns.sort(key=lambda turn: (turn.arrival_s, turn.conversation_id, turn.turn_index))
    return turns

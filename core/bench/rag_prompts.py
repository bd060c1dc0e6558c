"""Seeded RAG prompts over the bundled corpus, the shape the engine benchmark measures.

A prompt is a system message, then 5 retrieved chunks and a question in the user
turn, rendered with the model's chat template (DESIGN, "facts already checked").
Its first segment is the system prefix (the system turn alone), so chunks warmed
right after it are moved, not exact hits, when the prompt runs.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from chunkcache.core.corpus import CorpusChunk
from chunkcache.core.segmenter import ChunkSegment, Segment, TextSegment, segment_prompt
from chunkcache.core.workload import QUESTION_TEMPLATES, random_phrase

SYSTEM_MESSAGE = (
    "You are a helpful assistant for Python programmers. Answer the question using only "
    "the documentation excerpts in the context, briefly, and name the functions you use."
)
TWO_CHUNK_TEMPLATES = (
    "How do {a} and {b} differ?",
    "When should I use {a} rather than {b}?",
    "Can {a} and {b} be used together? Explain.",
)
MIN_CHUNK_CHARS = 700  # corpus chunks are up to 1000 chars; keep those near ~256 tokens

Search = Callable[[str, int], Sequence[CorpusChunk]]


@dataclass(frozen=True)
class RagPrompt:
    """A rendered RAG prompt; ``segments[0]`` is the system prefix (the warm-up context)."""

    question: str
    asked: tuple[str, ...]  # ids of the chunks the question is about
    chunk_ids: tuple[str, ...]  # in prompt order
    text: str
    segments: tuple[Segment, ...]


def build_rag_prompts(
    corpus: Sequence[CorpusChunk],
    search: Search,
    tokenizer: Any,
    num_prompts: int,
    seed: int = 0,
    num_chunks: int = 5,
) -> list[RagPrompt]:
    """``num_prompts`` seeded prompts: a question on one chunk (or two: half of them), that
    chunk and its nearest neighbours by ``search`` in shuffled order, and the question."""
    rng = random.Random(seed)
    candidates = [chunk for chunk in corpus if len(chunk.text) >= MIN_CHUNK_CHARS]
    prompts: list[RagPrompt] = []
    seen: set[str] = set()
    for _ in range(50 * num_prompts):
        if len(prompts) == num_prompts:
            break
        chunk = rng.choice(candidates)
        question = rng.choice(QUESTION_TEMPLATES).format(
            title=chunk.title, topic=chunk.topic, phrase=random_phrase(chunk, rng)
        )
        company = {chunk.chunk_id: chunk}
        for found in search(question, 4 * num_chunks):
            if len(company) < num_chunks and len(found.text) >= MIN_CHUNK_CHARS:
                company.setdefault(found.chunk_id, found)
        chunks = list(company.values())
        asked = [chunk]
        other = next((c for c in chunks[1:] if c.title != chunk.title), None)
        if other is not None and rng.random() < 0.5:
            question = rng.choice(TWO_CHUNK_TEMPLATES).format(a=chunk.title, b=other.title)
            asked.append(other)
        rng.shuffle(chunks)
        prompt = render_prompt(tokenizer, chunks, question, tuple(c.chunk_id for c in asked))
        if len(chunks) == num_chunks and prompt is not None and question not in seen:
            seen.add(question)
            prompts.append(prompt)
    if len(prompts) < num_prompts:
        raise RuntimeError(f"could only build {len(prompts)} of {num_prompts} prompts")
    return prompts


def render_prompt(
    tokenizer: Any, chunks: Sequence[CorpusChunk], question: str, asked: tuple[str, ...]
) -> RagPrompt | None:
    """The chat-template prompt, segmented; None if a chunk was not found in it as a segment."""
    context = "\n\n".join(chunk.text for chunk in chunks)
    messages = [
        {"role": "system", "content": SYSTEM_MESSAGE},
        {"role": "user", "content": f"Context:\n\n{context}\n\nQuestion: {question}"},
    ]
    text = str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    system = str(tokenizer.apply_chat_template(messages[:1], tokenize=False))
    pairs = [(chunk.chunk_id, chunk.text) for chunk in chunks]
    segments = segment_prompt(text, None, explicit_chunks=pairs)
    found = tuple(s.chunk_id for s in segments if isinstance(s, ChunkSegment))
    head = segments[0]
    if found != tuple(p[0] for p in pairs) or not isinstance(head, TextSegment):
        return None
    if not head.text.startswith(system) or head.text == system:
        return None
    split = [TextSegment(system), TextSegment(head.text[len(system) :]), *segments[1:]]
    return RagPrompt(question, asked, found, text, tuple(split))


def corpus_search(question: str, k: int) -> list[CorpusChunk]:
    """The FAISS index of the bundled corpus (MiniLM embeddings), best first."""
    from chunkcache.integrations.indexes import search_corpus

    return [chunk for chunk, _ in search_corpus(question, "faiss", k)]

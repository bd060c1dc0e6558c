"""The requests a RAG benchmark replays, and the retriever each workload searches.

- ``corpus``: the bundled corpus in Chroma (MiniLM), a seeded multi-turn trace with Zipf
  topic popularity and follow-ups (:func:`~chunkcache.core.workload.multi_turn_trace`);
  ``min_turns = max_turns = 1`` makes it single-turn.
- ``gold``: fictional facts with gold answers (:mod:`.gold`), one question per
  conversation, its gold chunks and distractors as the retrieved set.
- ``user``: a user's own corpus (a folder of text files or a Chroma collection) indexed
  with MiniLM, and their questions file, one question per conversation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever

from chunkcache.core.bench.gold import GoldConfig, make_gold_workload, prompt_chunks
from chunkcache.core.chunk_ids import CHUNK_ID_METADATA_KEY
from chunkcache.core.corpus import DEFAULT_CHUNK_CHARS, CorpusChunk, load_corpus
from chunkcache.core.workload import WorkloadConfig, multi_turn_trace


@dataclass(frozen=True)
class BenchRequest:
    """One turn of one conversation; ``answer`` is its gold answer when the workload has one."""

    conversation_id: str
    question: str
    answer: str | None = None
    kind: str = "corpus"


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order and a factory of the base retriever they search."""

    name: str
    requests: list[BenchRequest]
    retriever: Callable[[], BaseRetriever]
    description: str


class GivenChunks(BaseRetriever):
    """Returns the chunks fixed for each question (the gold workload's retrieved set)."""

    chunks_by_question: dict[str, list[CorpusChunk]]

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        chunks = self.chunks_by_question.get(query)
        if chunks is None:
            raise KeyError(f"no chunks were fixed for the question {query!r}")
        return [
            Document(page_content=c.text, metadata={CHUNK_ID_METADATA_KEY: c.chunk_id})
            for c in chunks
        ]


def corpus_workload(
    conversations: int,
    min_turns: int,
    max_turns: int,
    k: int,
    seed: int,
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
) -> Workload:
    """The bundled corpus in chunks of at most ``chunk_chars`` characters, multi-turn (or
    single-turn with one turn each)."""
    from chunkcache.integrations.indexes import langchain_chunks_retriever

    config = WorkloadConfig(
        num_conversations=conversations, min_turns=min_turns, max_turns=max_turns, seed=seed
    )
    chunks = load_corpus(chunk_chars)
    turns = multi_turn_trace(chunks, config)
    requests = [BenchRequest(t.conversation_id, t.question) for t in turns]
    mode = "single-turn" if max_turns == 1 else f"{min_turns}-{max_turns} turns"
    return Workload(
        "corpus",
        requests,
        lambda: langchain_chunks_retriever(chunks, k=k),
        f"bundled corpus, {conversations} conversations ({mode}), Zipf topics, k={k}, "
        f"chunks of at most {chunk_chars} characters",
    )


def gold_chunks_needed(questions: int, seed: int) -> int:
    """The most gold chunks one of the first ``questions`` gold questions needs: the
    smallest ``k`` the gold workload runs with (0 without questions)."""
    chosen = make_gold_workload(GoldConfig(seed=seed)).questions[:questions]
    return max((len(q.chunk_ids) for q in chosen), default=0)


def gold_workload(questions: int, k: int, seed: int) -> Workload:
    """Fictional facts: ``questions`` single-turn questions with gold answers."""
    world = make_gold_workload(GoldConfig(seed=seed))
    chosen = world.questions[:questions]
    given = {q.question: prompt_chunks(world, q, k, seed) for q in chosen}
    requests = [BenchRequest(f"gold-{q.question_id}", q.question, q.answer, q.kind) for q in chosen]
    return Workload(
        "gold",
        requests,
        lambda: GivenChunks(chunks_by_question=given),
        f"fictional facts, {len(requests)} questions with gold answers "
        f"({sum(q.kind == 'two_chunk' for q in chosen)} need two chunks), k={k}",
    )


def user_workload(
    questions_file: Path,
    k: int,
    corpus_dir: Path | None = None,
    chroma: Sequence[str] | None = None,
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
) -> Workload:
    """A user's corpus (a folder, or ``chroma = (persist_dir, collection)``) and questions."""
    from chunkcache.core.user_corpus import (
        load_chroma_corpus,
        load_questions,
        load_text_folder,
    )
    from chunkcache.integrations.indexes import langchain_chunks_retriever

    if (corpus_dir is None) == (chroma is None):
        raise ValueError("give exactly one of a corpus folder and a Chroma collection")
    if corpus_dir is not None:
        chunks, source = load_text_folder(corpus_dir, chunk_chars), str(corpus_dir)
    else:
        assert chroma is not None
        chunks, source = load_chroma_corpus(chroma[0], chroma[1]), f"Chroma {chroma[1]}"
    asked = load_questions(questions_file)
    requests = [
        BenchRequest(f"user-{i:05d}", q.question, q.answer, q.kind) for i, q in enumerate(asked)
    ]

    def retriever() -> BaseRetriever:
        return langchain_chunks_retriever(chunks, k=k)

    return Workload(
        "user",
        requests,
        retriever,
        f"{source}: {len(chunks)} chunks, {len(requests)} questions, k={k}",
    )

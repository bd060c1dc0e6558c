"""A workload with gold answers: seeded facts about fictional companies and products.

The names are invented (:mod:`~chunkcache.core.bench.gold_prose`), so the model cannot
know the facts and must read them from the context.  Profile chunks state each
company's founding year, founder, headquarters city, staff and logo colour; catalogue
chunks state which company makes each product.  Distractor chunks mention the same
entities with other attributes (ticker, motto, prizes) or describe look-alikes
(``Velmara Tech`` beside ``Velmora Tech``) with other values.  ``two_chunk`` questions
ask about the maker of a product, so the product->company fact and the company's fact
sit in different chunks: CacheBlend's cross-attention case.

>>> workload = make_gold_workload(GoldConfig(num_companies=6, seed=1))
>>> question = workload.questions[0]
>>> prompt = prompt_chunks(workload, question, k=5)
>>> len(prompt), set(question.chunk_ids) <= {chunk.chunk_id for chunk in prompt}
(5, True)
>>> exact_match("It was founded in 1923.", "1923"), exact_match("1932", "1923")
(True, False)
"""

from __future__ import annotations

import functools
import random
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from chunkcache.core.bench.gold_prose import CHUNK_KINDS, Company, Names, make_company, make_twin
from chunkcache.core.chunk_ids import chunk_id
from chunkcache.core.corpus import CorpusChunk

QuestionKind = Literal["single", "two_chunk"]
MAX_ANSWER_WORDS = 12
_SINGLE = (
    ("In which year was {c} founded?", "year"),
    ("In which city is {c} headquartered?", "city"),
    ("Who founded {c}?", "founder"),
    ("How many people does {c} employ?", "staff"),
    ("What colour is the logo of {c}?", "colour"),
)
_TWO_CHUNK = (
    ("Who founded the company that makes the {p}?", "founder"),
    ("In which city is the company that makes the {p} headquartered?", "city"),
    ("In which year was the company that makes the {p} founded?", "year"),
)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_DIGIT_GROUP = re.compile(r"(?<=\d),(?=\d{3}\b)")


@dataclass(frozen=True)
class GoldConfig:
    """Size of the fictional world (one product per company) and its seed."""

    num_companies: int = 24
    companies_per_chunk: int = 3  # in profile chunks
    products_per_chunk: int = 4  # in catalogue and news chunks
    seed: int = 0


@dataclass(frozen=True)
class GoldQuestion:
    """A question, its short gold answer and the ids of the chunks that state its facts.

    ``entities`` are the names the question passes through: the subject, or for a
    ``two_chunk`` question the product and then its maker.  ``distractor_ids`` are the
    other chunks about that company, its product or their look-alikes.
    """

    question_id: str
    question: str
    answer: str
    kind: QuestionKind
    chunk_ids: tuple[str, ...]
    entities: tuple[str, ...]
    distractor_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class GoldWorkload:
    """The chunks (gold and distractor, plain :class:`CorpusChunk`) and the questions."""

    chunks: list[CorpusChunk]
    questions: list[GoldQuestion]
    config: GoldConfig

    @functools.cached_property
    def chunks_by_id(self) -> dict[str, CorpusChunk]:
        """Chunks by their id."""
        return {chunk.chunk_id: chunk for chunk in self.chunks}


def make_gold_workload(config: GoldConfig | None = None) -> GoldWorkload:
    """The seeded world in chunks of 150-250 words (240-300 SmolLM2 tokens), and questions in a
    seeded order (any prefix is a fair mix of subjects and kinds)."""
    config = config or GoldConfig()
    if min(config.num_companies - 1, config.companies_per_chunk, config.products_per_chunk) < 1:
        raise ValueError(f"need 2+ companies and 1+ entity per chunk, got {config}")
    rng = random.Random(config.seed)
    names = Names(rng)
    cities = [names.word(rng.choice((2, 3))) for _ in range(max(4, config.num_companies // 2))]
    real = [make_company(names, rng, cities) for _ in range(config.num_companies)]
    twins = [make_twin(names, rng, cities, company) for company in real]
    chunks: list[CorpusChunk] = []
    where: dict[str, dict[str, str]] = {}  # company name -> chunk kind -> chunk id
    for kind, (look_alikes, about_product, is_profile, write) in CHUNK_KINDS.items():
        order = list(twins if look_alikes else real)
        rng.shuffle(order)  # the companies sharing a chunk differ from kind to kind
        per_chunk = config.companies_per_chunk if is_profile else config.products_per_chunk
        for start in range(0, len(order), per_chunk):
            group = order[start : start + per_chunk]
            title = f"{kind.capitalize()}: " + ", ".join(
                c.product if about_product else c.name for c in group
            )
            text = "\n\n".join([title, *(write(company, rng) for company in group)])
            chunks.append(CorpusChunk(chunk_id(text), text, f"gold {kind}", title, "gold"))
            for company in group:
                where.setdefault(company.name, {})[kind] = chunks[-1].chunk_id
    questions = [
        question
        for company, twin in zip(real, twins, strict=True)
        for question in _questions(company, where[company.name], where[twin.name])
    ]
    rng.shuffle(questions)
    for number, question in enumerate(questions):
        questions[number] = replace(question, question_id=f"gold-{config.seed}-{number:04d}")
    return GoldWorkload(chunks, questions, config)


def _questions(c: Company, chunks: dict[str, str], twin: dict[str, str]) -> list[GoldQuestion]:
    """Single-fact questions on ``c`` and its product, and two-chunk ones via the product.

    ``chunks`` and ``twin`` map chunk kinds to the chunks about ``c`` and its look-alike;
    all of them but a question's gold chunks are its distractors.
    """
    values = {"year": str(c.year), "city": c.city, "founder": c.founder}
    values |= {"staff": f"{c.staff:,}", "colour": c.colour}
    about = [*chunks.values(), *twin.values()]
    profile, catalogue = chunks["profiles"], chunks["catalogue"]

    def ask(text: str, answer: str, gold: tuple[str, ...], *entities: str) -> GoldQuestion:
        kind: QuestionKind = "single" if len(gold) == 1 else "two_chunk"
        others = tuple(cid for cid in about if cid not in gold)
        return GoldQuestion("", text, answer, kind, gold, entities, others)

    return [
        *(ask(t.format(c=c.name), values[key], (profile,), c.name) for t, key in _SINGLE),
        ask(f"Which company makes the {c.product}?", c.name, (catalogue,), c.product),
        *(
            ask(t.format(p=c.product), values[key], (catalogue, profile), c.product, c.name)
            for t, key in _TWO_CHUNK
        ),
    ]


def prompt_chunks(
    workload: GoldWorkload, question: GoldQuestion, k: int = 5, seed: int = 0
) -> list[CorpusChunk]:
    """The ``k`` chunks a prompt for ``question`` carries, shuffled with ``seed``: its gold
    chunks, then distractors, then other chunks of the workload, drawn at random."""
    if k < len(question.chunk_ids):
        raise ValueError(f"k={k} is fewer than the {len(question.chunk_ids)} gold chunks")
    rng = random.Random(f"{seed}/{question.question_id}")
    distractors = list(question.distractor_ids)
    taken = {*question.chunk_ids, *distractors}
    others = [chunk.chunk_id for chunk in workload.chunks if chunk.chunk_id not in taken]
    rng.shuffle(distractors)
    rng.shuffle(others)
    chosen = [*question.chunk_ids, *distractors, *others][:k]
    rng.shuffle(chosen)
    return [workload.chunks_by_id[cid] for cid in chosen]


def mentions(text: str, name: str) -> bool:
    """Whether ``name`` stands in ``text`` as whole words (``Velmora Tech`` is not in
    ``Velmara Tech`` nor in ``Velmora Technics``)."""
    return _whole_words(name).search(text) is not None


@functools.lru_cache(maxsize=4096)
def _whole_words(name: str) -> re.Pattern[str]:
    return re.compile(rf"(?<!\w){re.escape(name)}(?!\w)")


def normalize_answer(text: str) -> str:
    """NFKC, lower case, no possessive ``'s``, digit-group commas dropped (``4,310`` ->
    ``4310``), other punctuation and symbols as spaces, no articles, single spaces."""
    text = unicodedata.normalize("NFKC", text).lower().replace("\u2019", "'")
    text = _DIGIT_GROUP.sub("", re.sub(r"'s\b", "", text))
    text = "".join(" " if unicodedata.category(ch)[0] in "PS" else ch for ch in text)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(answer: str, gold: str, max_words: int = MAX_ANSWER_WORDS) -> bool:
    """Whether ``answer`` gives ``gold``, compared after :func:`normalize_answer`.

    The rule: equal, or the gold stands as a whole-word span in an answer of at most
    ``max_words`` words ("It was founded in 1923." matches "1923"; "1923s" does not).
    The cap keeps an answer that lists many candidates from scoring by luck.
    """
    answer_norm, gold_norm = normalize_answer(answer), normalize_answer(gold)
    if not gold_norm:
        raise ValueError(f"gold answer {gold!r} is empty after normalisation")
    if answer_norm == gold_norm:
        return True
    return len(answer_norm.split()) <= max_words and mentions(answer_norm, gold_norm)


class Answerable(Protocol):
    """A question with an optional gold answer and a kind (``GoldQuestion`` and others)."""

    @property
    def answer(self) -> str | None: ...

    @property
    def kind(self) -> str: ...


@dataclass(frozen=True)
class GoldScore:
    """Exact-match accuracy over the questions that have a gold answer, and per kind."""

    num_scored: int
    num_correct: int
    accuracy: float
    by_kind: dict[str, float]


def score_answers(questions: Sequence[Answerable], answers: Sequence[str]) -> GoldScore:
    """Score ``answers[i]`` against ``questions[i].answer``; questions without one are skipped."""
    if len(questions) != len(answers):
        raise ValueError(f"{len(questions)} questions but {len(answers)} answers")
    hits: dict[str, list[bool]] = {}
    for question, answer in zip(questions, answers, strict=True):
        if question.answer is not None:
            hits.setdefault(question.kind, []).append(exact_match(answer, question.answer))
    every = [hit for kind_hits in hits.values() for hit in kind_hits]
    by_kind = {kind: sum(h) / len(h) for kind, h in sorted(hits.items())}
    return GoldScore(len(every), sum(every), sum(every) / len(every) if every else 0.0, by_kind)

"""The gold-answer workload: seeded, every answer stated where it says, distractors clean."""

import functools
import re
import subprocess
import sys
from collections import Counter

import pytest

from chunkcache.core.bench.gold import (
    GoldConfig,
    GoldQuestion,
    exact_match,
    make_gold_workload,
    mentions,
    normalize_answer,
    prompt_chunks,
    score_answers,
)
from chunkcache.core.chunk_ids import chunk_id

_SENTENCE = re.compile(r"(?<=[.!?\"])\s+|\n+")


@pytest.fixture(scope="module", params=[0, 7])
def workload(request):
    return make_gold_workload(GoldConfig(seed=request.param))


def states(text: str, subject: str, value: str) -> bool:
    """Whether one sentence of ``text`` names ``subject`` and ``value``."""
    return mentions(text, subject) and any(
        mentions(s, subject) and mentions(s, value) for s in _sentences(text)
    )


@functools.cache
def _sentences(text: str) -> list[str]:
    return _SENTENCE.split(text)


def test_same_seed_same_workload_other_seed_other_workload():
    first, again = make_gold_workload(GoldConfig(seed=3)), make_gold_workload(GoldConfig(seed=3))
    assert first == again
    other = make_gold_workload(GoldConfig(seed=4))
    assert {c.chunk_id for c in first.chunks}.isdisjoint(c.chunk_id for c in other.chunks)


def test_chunks_are_corpus_chunks_of_about_256_tokens(workload):
    ids = [chunk.chunk_id for chunk in workload.chunks]
    assert len(set(ids)) == len(ids)
    for chunk in workload.chunks:
        assert chunk.chunk_id == chunk_id(chunk.text)
        assert chunk.text.splitlines()[0] == chunk.title
        assert 150 <= len(chunk.text.split()) <= 250, chunk.text


def test_questions_cover_both_kinds_and_every_fact(workload):
    counts = Counter(question.kind for question in workload.questions)
    assert counts == {"single": 6 * 24, "two_chunk": 3 * 24}
    assert len({q.question for q in workload.questions}) == len(workload.questions)
    assert len({q.question_id for q in workload.questions}) == len(workload.questions)
    # A prefix is a mix, not all questions about one company.
    assert set(Counter(q.kind for q in workload.questions[:30])) == {"single", "two_chunk"}


def test_single_answers_are_stated_in_their_gold_chunk_only(workload):
    for question in (q for q in workload.questions if q.kind == "single"):
        (subject,) = question.entities
        assert mentions(question.question, subject)
        holders = {c.chunk_id for c in workload.chunks if states(c.text, subject, question.answer)}
        assert holders == set(question.chunk_ids), question


def test_two_chunk_questions_need_both_chunks(workload):
    by_id = workload.chunks_by_id
    for question in (q for q in workload.questions if q.kind == "two_chunk"):
        product, maker = question.entities
        assert mentions(question.question, product) and not mentions(question.question, maker)
        catalogue, profile = (by_id[cid] for cid in question.chunk_ids)
        assert catalogue.chunk_id != profile.chunk_id
        links = {c.chunk_id for c in workload.chunks if states(c.text, product, maker)}
        facts = {c.chunk_id for c in workload.chunks if states(c.text, maker, question.answer)}
        assert links == {catalogue.chunk_id} and facts == {profile.chunk_id}, question
        # The bridge is only in the other chunk: no chunk names the product and the answer.
        for chunk in workload.chunks:
            assert not (mentions(chunk.text, product) and mentions(chunk.text, question.answer))
        assert not mentions(profile.text, product)


def test_distractors_mention_the_entities_or_look_alikes_but_not_the_fact(workload):
    by_id = workload.chunks_by_id
    for question in workload.questions:
        assert len(question.distractor_ids) >= 3
        assert set(question.distractor_ids).isdisjoint(question.chunk_ids)
        topics = {by_id[cid].topic for cid in question.distractor_ids}
        assert any("look-alike" in topic for topic in topics), question
        subject = question.entities[-1]
        for cid in question.distractor_ids:
            assert not states(by_id[cid].text, subject, question.answer), (question, cid)


def test_look_alikes_have_other_values(workload):
    """Each look-alike profile differs from a real company's name in one letter and in
    every asked value."""
    profiles = [c for c in workload.chunks if c.topic == "gold profiles"]
    twins = [c for c in workload.chunks if c.topic == "gold look-alike profiles"]
    real = {name for c in profiles for name in c.title.split(": ", 1)[1].split(", ")}
    fake = {name for c in twins for name in c.title.split(": ", 1)[1].split(", ")}
    assert real.isdisjoint(fake) and len(fake) == len(real)
    for name in fake:
        assert sum(_one_letter_apart(name, other) for other in real) >= 1, name
    for question in workload.questions:
        if question.kind == "single" and question.entities[0] in real:
            for chunk in twins:
                assert not states(chunk.text, question.entities[0], question.answer)


def _one_letter_apart(a: str, b: str) -> bool:
    return len(a) == len(b) and sum(x != y for x, y in zip(a, b, strict=True)) == 1


def test_prompt_chunks_carry_the_gold_then_distractors_shuffled(workload):
    question = next(q for q in workload.questions if q.kind == "two_chunk")
    chunks = prompt_chunks(workload, question, k=5, seed=1)
    ids = [chunk.chunk_id for chunk in chunks]
    assert len(ids) == len(set(ids)) == 5
    assert set(question.chunk_ids) <= set(ids)
    assert set(ids) - set(question.chunk_ids) <= set(question.distractor_ids)
    assert prompt_chunks(workload, question, k=5, seed=1) == chunks
    orders = {tuple(c.chunk_id for c in prompt_chunks(workload, question, 5, s)) for s in range(8)}
    assert len(orders) > 1
    wide = prompt_chunks(workload, question, k=12)
    assert len(wide) == 12 and set(question.distractor_ids) <= {c.chunk_id for c in wide}
    assert len(prompt_chunks(workload, question, k=1000)) == len(workload.chunks)
    with pytest.raises(ValueError, match="fewer than"):
        prompt_chunks(workload, question, k=1)


@pytest.mark.parametrize(
    ("answer", "gold", "expected"),
    [
        ("1923", "1923", True),
        ("It was founded in 1923.", "1923", True),
        ("1932", "1923", False),
        ("19234", "1923", False),
        ("The Velmora Tech.", "Velmora Tech", True),
        ("velmora   TECH", "Velmora Tech", True),
        ("Velmora Tech's founder", "Velmora Tech", True),
        ("Velmara Tech", "Velmora Tech", False),
        ("Velmora", "Velmora Tech", False),
        ("4310 people", "4,310", True),
        ("4,310", "4310", True),
        ("About 4,300 people.", "4,310", False),
        ("Ilsa Tovren founded it.", "Ilsa Tovren", True),
        ("Ilsa", "Ilsa Tovren", False),
        ("“Teal”!", "teal", True),
        ("Café Nord", "CAFÉ NORD", True),
        ("one two three four five six seven eight nine ten eleven teal", "teal", True),
        ("one two three four five six seven eight nine ten eleven twelve teal", "teal", False),
        ("", "teal", False),
    ],
)
def test_exact_match(answer, gold, expected):
    assert exact_match(answer, gold) is expected


def test_normalize_answer_and_empty_gold():
    assert normalize_answer("  The  Quillon-drill, an A+ tool! ") == "quillon drill tool"
    with pytest.raises(ValueError, match="empty"):
        exact_match("anything", "the ...")


def test_score_answers_per_kind_and_skips_questions_without_gold(workload):
    questions = workload.questions[:10]
    answers = [q.answer if i % 2 == 0 else "no idea" for i, q in enumerate(questions)]
    score = score_answers(questions, answers)
    assert (score.num_scored, score.num_correct, score.accuracy) == (10, 5, 0.5)
    assert set(score.by_kind) == {q.kind for q in questions}

    class Unanswered:
        answer = None
        kind = "user"

    score = score_answers([*questions[:2], Unanswered()], [questions[0].answer, "x", "y"])
    assert (score.num_scored, score.num_correct, score.by_kind.get("user")) == (2, 1, None)
    assert score_answers([], []).accuracy == 0.0
    with pytest.raises(ValueError, match="answers"):
        score_answers(questions, answers[:3])


def test_question_dataclass_is_plain_data(workload):
    question = workload.questions[0]
    assert isinstance(question, GoldQuestion) and hash(question)


def test_importing_gold_imports_no_torch():
    code = "import sys, chunkcache.core.bench.gold\nassert 'torch' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], check=True)

"""``with_chunk_history`` turns of one session at once, where one trims the saved history:
a trim rewrites it (clear, then add what is kept), so without the session's lock a turn
saved in between was lost, and two trims at once left the kept turns in it twice.

The bad interleavings are forced with hooks in the history's operations: a hook lets the
other turn go first up to its own step, or until it waits for the session's lock (the
lock makes it wait: that is the fix).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import pytest
from concurrency_support import TIMEOUT_S, await_until, wait_until
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.prompt_values import PromptValue
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda

import chunkcache.integrations.langchain_history as langchain_history
from chunkcache.integrations.langchain_chat_turns import HISTORY_LOCKS, Turn
from chunkcache.integrations.langchain_history import chunk_chat_prompt, with_chunk_history

SESSION = "s"
CONFIG = RunnableConfig(configurable={"session_id": SESSION})


class HookedHistory:
    """A session's messages in memory; ``before[op]`` (``abefore[op]`` in the async
    methods), if set, runs before each ``clear`` or ``add``."""

    def __init__(self, messages: Sequence[BaseMessage]) -> None:
        self._messages = list(messages)
        self.before: dict[str, Callable[[], None]] = {}
        self.abefore: dict[str, Callable[[], Awaitable[None]]] = {}

    @property
    def messages(self) -> list[BaseMessage]:
        return list(self._messages)

    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        self._run("add")
        self._messages.extend(messages)

    def clear(self) -> None:
        self._run("clear")
        self._messages = []

    async def aget_messages(self) -> list[BaseMessage]:
        return list(self._messages)

    async def aadd_messages(self, messages: Sequence[BaseMessage]) -> None:
        await self._arun("add")
        self._messages.extend(messages)

    async def aclear(self) -> None:
        await self._arun("clear")
        self._messages = []

    def _run(self, op: str) -> None:
        hook = self.before.get(op)
        if hook is not None:
            hook()

    async def _arun(self, op: str) -> None:
        hook = self.abefore.get(op)
        if hook is not None:
            await hook()

    def questions(self) -> list[str]:
        return [str(m.content) for m in self._messages if isinstance(m, HumanMessage)]


def earlier_turns(n: int) -> list[BaseMessage]:
    return [m for i in range(n) for m in (HumanMessage(f"q{i}"), AIMessage(f"a{i}"))]


def question_of(prompt: PromptValue) -> str:
    return str(prompt.to_messages()[-1].content)


class Answers:
    """The chain's model: answers each question; a question in ``gates`` (``agates``)
    first calls (awaits) its gate."""

    def __init__(self) -> None:
        self.gates: dict[str, Callable[[], None]] = {}
        self.agates: dict[str, Callable[[], Awaitable[None]]] = {}

    def answer(self, prompt: PromptValue) -> AIMessage:
        question = question_of(prompt)
        gate = self.gates.get(question)
        if gate is not None:
            gate()
        return AIMessage(f"answer to {question}")

    async def aanswer(self, prompt: PromptValue) -> AIMessage:
        question = question_of(prompt)
        gate = self.agates.get(question)
        if gate is not None:
            await gate()
        return AIMessage(f"answer to {question}")


def chat(
    history: HookedHistory, answers: Answers, max_history_turns: int | None
) -> Runnable[dict[str, Any], Any]:
    """A chat over ``history`` (every session's), retrieving nothing."""
    model = RunnableLambda(answers.answer, afunc=answers.aanswer)
    return with_chunk_history(
        chunk_chat_prompt("Answer.") | model,
        RunnableLambda(no_documents),
        lambda session_id: history,
        max_history_turns=max_history_turns,
    )


def no_documents(question: str) -> list[Document]:
    return []


def other_turn_waits() -> bool:
    """Whether a turn of the session waits for its lock (the fix keeps it out)."""
    return HISTORY_LOCKS.waiting(SESSION) > 0


def run_thread(call: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def assert_each_turn_once(history: HookedHistory, questions: list[str]) -> None:
    assert sorted(history.questions()) == sorted(questions)
    assert len(history.messages) == 2 * len(questions)


def test_a_turn_saved_while_another_trims_the_history_is_kept() -> None:
    """B answers while A trims (it read three turns, max two): B's save must not land
    between A's read and A's rewrite, which would drop it."""
    history, answers = HookedHistory(earlier_turns(2)), Answers()
    chain = chat(history, answers, max_history_turns=2)
    b_answering, a_trimming, b_saving = threading.Event(), threading.Event(), threading.Event()

    def b_answers_once_a_trims() -> None:
        b_answering.set()
        assert a_trimming.wait(TIMEOUT_S)

    answers.gates["qb"] = b_answers_once_a_trims
    b, b_errors = run_thread(lambda: chain.invoke({"question": "qb"}, CONFIG))
    assert b_answering.wait(TIMEOUT_S)  # B read two turns: it trims nothing
    chain.invoke({"question": "qc"}, CONFIG)  # a third turn: A's start trims

    def a_trims() -> None:
        history.before.pop("clear")
        history.before["add"] = b_saving.set  # B's save (on the old code, no lock)
        a_trimming.set()
        wait_until(lambda: b_saving.is_set() or other_turn_waits())

    history.before["clear"] = a_trims
    chain.invoke({"question": "qa"}, CONFIG)
    b.join(TIMEOUT_S)
    assert not b_errors, b_errors
    assert_each_turn_once(history, ["qc", "qa", "qb"])


async def test_an_async_turn_saved_while_another_trims_the_history_is_kept() -> None:
    history, answers = HookedHistory(earlier_turns(2)), Answers()
    chain = chat(history, answers, max_history_turns=2)
    b_answering, a_trimming, b_saving = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def b_answers_once_a_trims() -> None:
        b_answering.set()
        await a_trimming.wait()

    answers.agates["qb"] = b_answers_once_a_trims
    b = asyncio.create_task(chain.ainvoke({"question": "qb"}, CONFIG))
    await asyncio.wait_for(b_answering.wait(), TIMEOUT_S)
    await chain.ainvoke({"question": "qc"}, CONFIG)

    async def b_saves() -> None:
        b_saving.set()

    async def a_trims() -> None:
        history.abefore.pop("clear")
        history.abefore["add"] = b_saves
        a_trimming.set()
        await await_until(lambda: b_saving.is_set() or other_turn_waits())

    history.abefore["clear"] = a_trims
    await asyncio.wait_for(chain.ainvoke({"question": "qa"}, CONFIG), TIMEOUT_S)
    await asyncio.wait_for(b, TIMEOUT_S)
    assert_each_turn_once(history, ["qc", "qa", "qb"])


def test_two_turns_trimming_at_once_keep_each_turn_once() -> None:
    """A and B both read three turns (max two) and trim: without the lock both cleared,
    then both added the kept turn."""
    history, answers = HookedHistory(earlier_turns(3)), Answers()
    chain = chat(history, answers, max_history_turns=2)
    arrived = {"clear": 0, "add": 0}
    count = threading.Lock()

    def meet(op: str) -> Callable[[], None]:
        """Wait at ``op`` for the other turn to get there too (or to wait for the lock)."""

        def hook() -> None:
            with count:
                arrived[op] += 1
            wait_until(lambda: arrived[op] >= 2 or other_turn_waits())

        return hook

    history.before = {"clear": meet("clear"), "add": meet("add")}
    turns = [run_thread(partial(chain.invoke, {"question": q}, CONFIG)) for q in ("qa", "qb")]
    for thread, errors in turns:
        thread.join(TIMEOUT_S)
        assert not errors, errors
    assert_each_turn_once(history, ["q2", "qa", "qb"])


def fits_but(first_for: str, hook: Callable[[], None]) -> Callable[..., bool]:
    """A ``fits`` where the first prompt asking ``first_for`` does not fit: ``hook`` runs
    then (another turn goes on meanwhile); every other prompt fits."""
    calls: list[str] = []

    def fits(self: object, turn: Turn) -> bool:
        question = turn.chain_input["question"]
        calls.append(question)
        if question == first_for and calls.count(question) == 1:
            hook()
            return False
        return True

    return fits


def test_a_turn_saved_while_another_trims_to_fit_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A's prompt does not fit; B is saved while A counts; then A saves its trim: it must
    trim the history as it is then, not write back what it read."""
    history, answers = HookedHistory(earlier_turns(2)), Answers()
    chain = chat(history, answers, max_history_turns=None)

    def b_turn() -> None:
        chain.invoke({"question": "qb"}, CONFIG)

    monkeypatch.setattr(langchain_history._ChunkHistoryTurns, "fits", fits_but("qa", b_turn))
    chain.invoke({"question": "qa"}, CONFIG)
    assert history.questions() == ["q1", "qb", "qa"]  # A dropped q0 only
    assert_each_turn_once(history, ["q1", "qb", "qa"])


async def test_an_async_turn_saved_while_another_trims_to_fit_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    history, answers = HookedHistory(earlier_turns(2)), Answers()
    chain = chat(history, answers, max_history_turns=None)
    loop = asyncio.get_running_loop()

    def b_turn() -> None:  # A counts in a worker thread: B runs on the loop meanwhile
        asyncio.run_coroutine_threadsafe(chain.ainvoke({"question": "qb"}, CONFIG), loop).result(
            TIMEOUT_S
        )

    monkeypatch.setattr(langchain_history._ChunkHistoryTurns, "fits", fits_but("qa", b_turn))
    await asyncio.wait_for(chain.ainvoke({"question": "qa"}, CONFIG), TIMEOUT_S)
    assert history.questions() == ["q1", "qb", "qa"]
    assert_each_turn_once(history, ["q1", "qb", "qa"])

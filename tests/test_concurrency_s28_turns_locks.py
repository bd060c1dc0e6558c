"""The session locks chat helpers hold while they read, trim or save a session's history,
and :func:`retrimmed`, which applies a trim decided on an earlier read to the history as it
is now.  Threads and asyncio tasks of one session take turns; other sessions do not wait;
a task waits without blocking its event loop; a waiter that gives up passes the lock on;
the table keeps no entry for a lock no one holds."""

from __future__ import annotations

import asyncio
import threading

import pytest
from concurrency_support import TIMEOUT_S, await_until, wait_until

from chunkcache.core.chat_turns import retrimmed
from chunkcache.core.session_locks import SessionLocks


def test_threads_of_one_session_take_turns_first_come_first_served() -> None:
    locks = SessionLocks()
    order: list[str] = []

    def take(name: str) -> None:
        with locks.hold("s"):
            order.append(name)

    with locks.hold("s"):
        threads = []
        for name in "abc":
            thread = threading.Thread(target=take, args=(name,))
            thread.start()
            threads.append(thread)
            wait_until(lambda: locks.waiting("s") == len(threads))
        with locks.hold("t"):  # another session does not wait
            assert len(locks) == 2
        assert order == []
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert order == ["a", "b", "c"]
    assert len(locks) == 0 and locks.waiting("s") == 0


async def test_a_task_waits_for_a_thread_without_blocking_its_loop() -> None:
    locks = SessionLocks()
    held, free = threading.Event(), threading.Event()
    order: list[str] = []

    def thread_holds() -> None:
        with locks.hold("s"):
            held.set()
            free.wait(TIMEOUT_S)
            order.append("thread")

    thread = threading.Thread(target=thread_holds)
    thread.start()
    await asyncio.to_thread(held.wait, TIMEOUT_S)

    async def task_takes() -> None:
        async with locks.ahold("s"):
            order.append("task")

    task = asyncio.create_task(task_takes())
    await await_until(lambda: locks.waiting("s") == 1)  # the loop runs while the task waits
    free.set()
    await asyncio.wait_for(task, TIMEOUT_S)
    thread.join(TIMEOUT_S)
    assert order == ["thread", "task"] and len(locks) == 0


async def test_a_thread_waits_for_a_task() -> None:
    locks = SessionLocks()
    order: list[str] = []

    def thread_takes() -> None:
        with locks.hold("s"):
            order.append("thread")

    async with locks.ahold("s"):
        thread = threading.Thread(target=thread_takes)
        thread.start()
        await await_until(lambda: locks.waiting("s") == 1)
        order.append("task")
    await asyncio.to_thread(thread.join, TIMEOUT_S)
    assert order == ["task", "thread"] and len(locks) == 0


async def test_a_task_cancelled_while_waiting_passes_its_turn_on() -> None:
    locks = SessionLocks()
    order: list[str] = []

    async def take(name: str) -> None:
        async with locks.ahold("s"):
            order.append(name)

    async with locks.ahold("s"):
        first = asyncio.create_task(take("first"))
        second = asyncio.create_task(take("second"))
        await await_until(lambda: locks.waiting("s") == 2)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert locks.waiting("s") == 1
    await asyncio.wait_for(second, TIMEOUT_S)
    assert order == ["second"] and len(locks) == 0


@pytest.mark.parametrize("handed", ["handover to run", "handover run"])
async def test_a_task_cancelled_once_handed_the_lock_passes_it_on(handed: str) -> None:
    """The lock is handed to a task cancelled before it runs again: before or after the
    handover ran on its loop."""
    locks = SessionLocks()
    order: list[str] = []

    async def take(name: str) -> None:
        async with locks.ahold("s"):
            order.append(name)

    async with locks.ahold("s"):
        first = asyncio.create_task(take("first"))
        second = asyncio.create_task(take("second"))
        await await_until(lambda: locks.waiting("s") == 2)
    assert locks.waiting("s") == 1  # handed to ``first``
    if handed == "handover run":
        await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, TIMEOUT_S)
    assert order == ["second"] and len(locks) == 0


@pytest.mark.parametrize("task", ["holds", "waits"])
async def test_a_sync_hold_on_the_loop_of_a_task_holding_or_awaiting_the_lock_is_refused(
    task: str,
) -> None:
    """Blocking the loop's thread, it would wait forever for that task."""
    locks = SessionLocks()
    thread_holds, free_thread, free_task = threading.Event(), threading.Event(), asyncio.Event()

    def thread_holds_it() -> None:
        with locks.hold("s"):
            thread_holds.set()
            free_thread.wait(TIMEOUT_S)

    async def task_holds_it() -> None:
        async with locks.ahold("s"):
            await free_task.wait()

    thread = threading.Thread(target=thread_holds_it)
    if task == "waits":  # a thread holds the lock: the task waits for it
        thread.start()
        await asyncio.to_thread(thread_holds.wait, TIMEOUT_S)
    holder = asyncio.create_task(task_holds_it())
    await await_until(lambda: len(locks) == 1 and locks.waiting("s") == int(task == "waits"))
    with pytest.raises(RuntimeError, match="async API"), locks.hold("s"):
        pass
    with locks.hold("other"):  # another session's lock is free
        pass
    free_thread.set()
    free_task.set()
    await asyncio.wait_for(holder, TIMEOUT_S)
    if task == "waits":
        await asyncio.to_thread(thread.join, TIMEOUT_S)
    assert len(locks) == 0


def test_the_table_holds_only_locks_in_use() -> None:
    locks = SessionLocks()
    for i in range(1000):
        with locks.hold(f"session-{i}"):
            assert len(locks) == 1
    assert len(locks) == 0


def test_a_lock_named_for_later_is_the_sessions() -> None:
    locks = SessionLocks()
    lock = locks.lock("s")
    with lock.hold():
        assert len(locks) == 1 and lock.key == "s"
    assert len(locks) == 0


@pytest.mark.parametrize(
    ("current", "began", "kept", "expected"),
    [
        ("abcd", "abcd", "cd", "cd"),  # nothing changed since
        ("abcdef", "abcd", "cd", "cdef"),  # a turn saved since stays
        ("bcdef", "abcd", "cd", "cdef"),  # another trim dropped less: the rest goes
        ("def", "abcd", "cd", "def"),  # another trim dropped more: nothing comes back
        ("ef", "abcd", "cd", "ef"),  # cleared or rewritten since: left as it is
        ("abcdef", "abcd", "", "ef"),  # all of what was read goes, what came since stays
        ("abab", "abab", "ab", "ab"),  # repeated messages
        ("ababx", "abab", "ab", "abx"),
    ],
)
def test_a_trim_is_applied_to_the_history_as_it_is_now(
    current: str, began: str, kept: str, expected: str
) -> None:
    assert retrimmed(list(current), list(began), list(kept)) == list(expected)

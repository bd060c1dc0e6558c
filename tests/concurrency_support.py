"""Threads and waits for the concurrency tests: each fails, rather than hangs, past TIMEOUT_S."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

TIMEOUT_S = 60


def run_threads(calls: list[Callable[[], object]]) -> list[BaseException]:
    """Run each of ``calls`` in its own thread; what they raised.  Fails if one hangs."""
    errors: list[BaseException] = []

    def run(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(call,), daemon=True) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    return errors


def wait_until(done: Callable[[], bool]) -> None:
    """Wait (in this thread) until ``done()``; fails past TIMEOUT_S."""
    deadline = time.monotonic() + TIMEOUT_S
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


async def await_until(done: Callable[[], bool]) -> None:
    """Wait (letting the event loop run) until ``done()``; fails past TIMEOUT_S."""
    deadline = time.monotonic() + TIMEOUT_S
    while not done():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)

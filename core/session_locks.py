"""One lock per chat session, for threads and asyncio tasks alike.

Turns of one conversation may run at once (two tabs, a retry while the first try still
streams), from threads or from tasks of an event loop.  The steps that read or rewrite a
session's saved history (a trim, a finished turn's save) must take turns: a
``threading.Lock`` would block an event loop, an ``asyncio.Lock`` serves one loop only.
:class:`SessionLocks` queues threads (blocking) and tasks (awaiting) of one session in one
first-come, first-served line.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
)
from dataclasses import dataclass, field
from typing import TypeVar


class _ThreadWaiter:
    """A thread waiting for a session's lock."""

    loop: asyncio.AbstractEventLoop | None = None  # a thread holds the lock, not a task

    def __init__(self) -> None:
        self._granted = threading.Event()

    def grant(self) -> bool:
        self._granted.set()
        return True

    def owns(self) -> bool:
        return self._granted.is_set()

    def wait(self) -> None:
        self._granted.wait()


class _TaskWaiter:
    """An asyncio task waiting for a session's lock: handed it on its own event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, release: Callable[[], None]) -> None:
        self.loop = loop
        self.granted: asyncio.Future[None] = loop.create_future()
        self._release = release

    def grant(self) -> bool:
        """Hand the lock over; False when the task's loop is closed (no one will take it)."""
        try:
            self.loop.call_soon_threadsafe(self._take)
        except RuntimeError:
            return False
        return True

    def owns(self) -> bool:
        return self.granted.done() and not self.granted.cancelled()

    def _take(self) -> None:
        if self.granted.cancelled():  # the task stopped waiting: the next waiter's turn
            self._release()
        else:
            self.granted.set_result(None)


_Waiter = _ThreadWaiter | _TaskWaiter
_W = TypeVar("_W", _ThreadWaiter, _TaskWaiter)


@dataclass
class _Held:
    """A held lock: the event loop of the task holding it (None: a thread holds it), and
    who waits for it."""

    loop: asyncio.AbstractEventLoop | None
    waiters: deque[_Waiter] = field(default_factory=deque)

    def awaited_on(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether a task of ``loop`` holds the lock or waits for it."""
        return self.loop is loop or any(waiter.loop is loop for waiter in self.waiters)


class SessionLocks:
    """One lock per session key, held while a step reads or rewrites that session's saved
    history (a trim, a finished turn's save), never while a chain runs.

    Threads wait blocking, asyncio tasks by awaiting (their event loop runs on), and a
    thread and a task of one session exclude each other; waiters are served first come,
    first served.  A key has an entry only while its lock is held, so the table never holds
    more entries than steps in flight.  Within one process only: processes sharing a history
    store are not ordered by it.  Not reentrant: a step must not take its own session's
    lock again.  A thread running an event loop that asks for a lock a task of that loop
    holds or waits for gets a RuntimeError: it would wait for a task that cannot run.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held: dict[Hashable, _Held] = {}

    def __len__(self) -> int:
        """The sessions whose lock is held now."""
        with self._mutex:
            return len(self._held)

    def waiting(self, key: Hashable) -> int:
        """How many threads and tasks wait for ``key``'s lock."""
        with self._mutex:
            held = self._held.get(key)
            return 0 if held is None else len(held.waiters)

    def lock(self, key: Hashable) -> SessionLock:
        """``key``'s lock, to hold later (:meth:`SessionLock.hold`, :meth:`SessionLock.ahold`)."""
        return SessionLock(self, key)

    @contextmanager
    def hold(self, key: Hashable) -> Iterator[None]:
        """Hold ``key``'s lock, blocking this thread until it is free."""
        self._refuse_deadlock(key)
        waiter = self._enqueue(key, _ThreadWaiter, None)
        if waiter is not None:
            try:
                waiter.wait()
            except BaseException:
                self._abandon(key, waiter)
                raise
        try:
            yield
        finally:
            self._release(key)

    @asynccontextmanager
    async def ahold(self, key: Hashable) -> AsyncIterator[None]:
        """Hold ``key``'s lock, awaiting it without blocking the event loop."""
        loop = asyncio.get_running_loop()
        waiter = self._enqueue(key, lambda: _TaskWaiter(loop, lambda: self._release(key)), loop)
        if waiter is not None:
            try:
                await waiter.granted
            except BaseException:  # cancelled while waiting
                self._abandon(key, waiter)
                raise
        try:
            yield
        finally:
            self._release(key)

    def _refuse_deadlock(self, key: Hashable) -> None:
        """A RuntimeError when this thread runs an event loop one of whose tasks holds or
        awaits ``key``'s lock: blocking here, the thread would never let it run."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop runs on this thread
        with self._mutex:
            held = self._held.get(key)
            if held is not None and held.awaited_on(loop):
                raise RuntimeError(
                    "a sync call on an event loop's thread would wait for a chat session "
                    "that a task of the same loop is saving, which cannot run meanwhile: "
                    "call the async API (ainvoke, astream, achat) from async code"
                )

    def _enqueue(
        self,
        key: Hashable,
        waiter: Callable[[], _W],
        loop: asyncio.AbstractEventLoop | None,
    ) -> _W | None:
        """Take ``key``'s lock if it is free (None; held by a task of ``loop``, or by a
        thread when None), else queue and return a new waiter."""
        with self._mutex:
            held = self._held.get(key)
            if held is None:
                self._held[key] = _Held(loop)
                return None
            queued = waiter()
            held.waiters.append(queued)
            return queued

    def _abandon(self, key: Hashable, waiter: _Waiter) -> None:
        """``waiter`` stops waiting: it leaves the queue, or passes on a lock it was handed.
        (A task's handover still to run on its loop passes it on itself: see ``_take``.)"""
        with self._mutex:
            held = self._held.get(key)
            if held is not None and waiter in held.waiters:
                held.waiters.remove(waiter)
                return
        if waiter.owns():
            self._release(key)

    def _release(self, key: Hashable) -> None:
        """Hand ``key``'s lock to the first waiter that can take it, else free it."""
        with self._mutex:
            held = self._held[key]
            while held.waiters:
                waiter = held.waiters.popleft()
                if waiter.grant():
                    held.loop = waiter.loop
                    return
            del self._held[key]


@dataclass(frozen=True)
class SessionLock:
    """One session's lock in a :class:`SessionLocks` table."""

    locks: SessionLocks
    key: Hashable

    def hold(self) -> AbstractContextManager[None]:
        return self.locks.hold(self.key)

    def ahold(self) -> AbstractAsyncContextManager[None]:
        return self.locks.ahold(self.key)

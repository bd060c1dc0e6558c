"""ReuseCount.record from many engine threads at once (a batching backend, or several backends
on one store) counts every reuse."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import pytest

from chunkcache.core.kv_store import ReuseCount

THREADS = 8
RECORDS = 200


class YieldingCfo(float):
    """A CFO whose comparison gives up the GIL: ``record`` compares it while it adds to the
    counters, which is where another thread's update would be lost.  Widens the window a
    thread switch needs to land in, so an unlocked counter loses updates on every run."""

    def __gt__(self, other: object) -> bool:
        time.sleep(0)
        return float(self) > other  # type: ignore[operator]

    def __lt__(self, other: object) -> bool:
        time.sleep(0)
        return float(self) < other  # type: ignore[operator]


class YieldingSum(float):
    """A running sum whose addition gives up the GIL between ``+=``'s read and its write."""

    def __add__(self, other: float) -> YieldingSum:
        time.sleep(0)
        return YieldingSum(float(self) + other)


@pytest.fixture
def eager_switching() -> Iterator[None]:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def hammer(count: ReuseCount, cfo: float) -> None:
    start = threading.Barrier(THREADS)

    def work() -> None:
        start.wait()
        for _ in range(RECORDS):
            count.record(cfo)

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


@pytest.mark.usefixtures("eager_switching")
@pytest.mark.parametrize(
    ("cfo", "start"),
    [(YieldingCfo(0.5), 0.0), (0.5, YieldingSum(0.0)), (0.5, 0.0)],
    ids=["yielding-cfo", "yielding-sum", "plain"],
)
def test_concurrent_records_are_all_counted(cfo: float, start: float) -> None:
    count = ReuseCount(0, start)
    hammer(count, cfo)
    assert count.num_reuses == THREADS * RECORDS
    assert count.frequency_reuse == THREADS * RECORDS * 2.0  # 1 / 0.5 each, exact in binary


def test_the_counter_stays_plain_numbers() -> None:
    """A tiered store saves the two numbers as JSON; equality ignores the lock."""
    count = ReuseCount(3, 12.5)
    assert (count.num_reuses, count.frequency_reuse) == (3, 12.5)
    assert count == ReuseCount(3, 12.5)
    assert "lock" not in repr(count)

"""HeapTrimmer: freed heap pages go back to the OS (glibc), and the server runs one."""

from __future__ import annotations

import time

import pytest

from chunkcache.core.serve.heap_trim import HeapTrimmer

needs_glibc = pytest.mark.skipif(not HeapTrimmer(1.0).supported, reason="not glibc")


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@needs_glibc
def test_trimming_returns_the_free_pages_inside_the_heap() -> None:
    # 64 KiB blocks come from the heap (below the mmap threshold); keeping every 16th
    # alive leaves the freed ones inside it, where free() alone returns nothing.
    blocks = [bytearray(64 * 1024) for _ in range(4096)]  # 256 MiB, touched
    kept = blocks[::16]
    del blocks
    before = resident_bytes()
    trimmer = HeapTrimmer(interval_s=0.01)
    trimmer.start()
    try:
        for _ in range(500):  # up to 5 s for the first trim
            if trimmer.trims:
                break
            time.sleep(0.01)
    finally:
        trimmer.stop()
    assert trimmer.trims >= 1
    assert before - resident_bytes() > 128 * 2**20
    assert len(kept) == 256


def test_a_trimmer_stops_and_refuses_a_bad_interval() -> None:
    trimmer = HeapTrimmer(interval_s=3600.0)
    trimmer.start()
    trimmer.stop()  # does not wait out the interval
    assert trimmer.trims == 0
    with pytest.raises(ValueError, match="interval_s"):
        HeapTrimmer(interval_s=0)

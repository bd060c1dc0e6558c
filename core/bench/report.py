"""What every benchmark report carries: summary statistics and the machine it ran on; and
how every report is written (:func:`write_report`)."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from chunkcache.core.atomic_files import write_files

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 1])."""
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]


# Below this many values a nearest-rank p99 is the largest one (rank ceil(0.99 n) = n).
TAIL_SAMPLES = 100


def tail_label(counts: Iterable[int | None]) -> str:
    """How a report names a nearest-rank p99 of table rows over ``counts`` values each:
    ``p99 (n=250)``; ``max (n=30)`` where every row has fewer than :data:`TAIL_SAMPLES`
    values, as it then is their maximum; ``p99 (n not recorded)`` for a report that did
    not record a count."""
    listed = list(counts)
    known = [n for n in listed if n is not None]
    if not known or len(known) < len(listed):
        return "p99 (n not recorded)"
    low, high = min(known), max(known)
    n = f"n={low}" if low == high else f"n={low}-{high}"
    if low >= TAIL_SAMPLES:
        return f"p99 ({n})"
    if high < TAIL_SAMPLES:
        return f"max ({n})"
    return f"p99, max where n < {TAIL_SAMPLES} ({n})"


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Mean, median and p99 of ``values``."""
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "p99": percentile(values, 0.99),
    }


def write_report(folder: Path, name: str, report: dict[str, Any], markdown: str) -> None:
    """Write ``folder/<name>.json`` (``report``) and ``folder/<name>.md`` (``markdown``), the
    folder made if missing, both written atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    write_files(
        {
            folder / f"{name}.json": json.dumps(report, indent=2) + "\n",
            folder / f"{name}.md": markdown,
        }
    )


def cpu_model() -> str:
    """The CPU's model name (Linux), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def source_commit() -> str:
    """The repository's commit, marked when tracked sources differ from it."""

    def git(*args: str) -> str:
        try:
            run = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)
        except OSError:
            return ""
        return run.stdout.strip() if run.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "core", "kernels")
    return commit + (" + local changes" if changed else "")


def environment(packages: Iterable[str] = ()) -> dict[str, str]:
    """Machine, Python, chunkcache's commit and the versions of ``packages``."""
    versions = {}
    for name in ("chunkcache", *packages):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {
        "cpu": cpu_model(),
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "commit": source_commit(),
        **versions,
    }


class CpuMeter:
    """How many cores this process, and everything else on the machine, used since start.

    Timings taken while other work ran are noisy; reports print this beside them.
    """

    def __init__(self) -> None:
        self.start = _cpu_snapshot()

    def share(self) -> dict[str, float]:
        """``own_cores`` and ``other_cores`` (average since start; NaN where unknown)."""
        now = _cpu_snapshot()
        wall = max(now[0] - self.start[0], 1e-9)
        own = (now[2] - self.start[2]) / wall
        return {"own_cores": own, "other_cores": max(0.0, (now[1] - self.start[1]) / wall - own)}


def _cpu_snapshot() -> tuple[float, float, float]:
    """(wall s, busy CPU s of the whole machine, CPU s of this process) on Linux."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:9]]
        busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # not idle/iowait
    except (OSError, ValueError):
        busy = math.nan
    own = os.times()
    return time.monotonic(), busy, own.user + own.system

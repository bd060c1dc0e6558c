"""``/metrics``: the server's counters in the Prometheus text format (version 0.0.4).

The server counts HTTP responses, generations and their prompt tokens by source; the
backend's ``metrics()`` (when it has one) and the tiered store's counters are appended as
``chunkcache_engine_*`` and ``chunkcache_store_*`` samples.
"""

from __future__ import annotations

import re
import threading
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from chunkcache.core.generation import GenerationStats

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_FIELDS = ("prompt", "reused", "recomputed", "computed", "completion")
_NAME = re.compile(r"[^a-zA-Z0-9_]")

Labels = tuple[tuple[str, str], ...]


class ServeMetrics:
    """Thread-safe counters and latency histograms of one server process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[Labels, float]] = defaultdict(lambda: defaultdict(float))
        self._help: dict[str, tuple[str, str]] = {}
        self._histograms: dict[str, list[float]] = {}  # bucket counts, then count, sum

    def inc(self, name: str, help_: str, value: float = 1.0, **labels: str) -> None:
        """Add ``value`` to counter ``name`` (created with ``help_`` on first use)."""
        with self._lock:
            self._help.setdefault(name, ("counter", help_))
            self._counters[name][tuple(sorted(labels.items()))] += value

    def observe(self, name: str, help_: str, seconds: float) -> None:
        """Record one latency in histogram ``name``."""
        with self._lock:
            self._help.setdefault(name, ("histogram", help_))
            counts = self._histograms.setdefault(name, [0.0] * (len(LATENCY_BUCKETS) + 2))
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    counts[i] += 1
            counts[-2] += 1
            counts[-1] += seconds

    def response(self, path: str, status: int) -> None:
        self.inc("chunkcache_http_responses_total", "HTTP responses", path=path, code=str(status))

    def generation(self, stats: GenerationStats) -> None:
        """A generation that ran to its end: its tokens by source, hits, latencies."""
        for source in TOKEN_FIELDS:
            value = float(getattr(stats, f"{source}_tokens"))
            self.inc(f"chunkcache_{source}_tokens_total", f"{source} tokens", value)
        self.inc("chunkcache_chunk_hits_total", "chunks served from cache", stats.chunk_hits)
        self.inc("chunkcache_chunk_misses_total", "chunks computed", stats.chunk_misses)
        self.observe("chunkcache_ttft_seconds", "time to first token", stats.ttft_s)
        self.observe("chunkcache_request_seconds", "time to last token", stats.total_s)

    def value(self, name: str, **labels: str) -> float:
        """A counter's current value (0 if never counted)."""
        with self._lock:
            return self._counters.get(name, {}).get(tuple(sorted(labels.items())), 0.0)

    def render(self, gauges: Mapping[str, float | Mapping[str, Any]]) -> str:
        """Every counter and histogram, then ``gauges`` (nested mappings become labels)."""
        lines: list[str] = []
        with self._lock:
            for name, samples in sorted(self._counters.items()):
                kind, help_ = self._help[name]
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
                lines += [f"{name}{_labels(k)} {_number(v)}" for k, v in sorted(samples.items())]
            for name, counts in sorted(self._histograms.items()):
                lines += [f"# HELP {name} {self._help[name][1]}", f"# TYPE {name} histogram"]
                for bound, count in zip(LATENCY_BUCKETS, counts, strict=False):
                    lines.append(f'{name}_bucket{{le="{bound}"}} {_number(count)}')
                lines.append(f'{name}_bucket{{le="+Inf"}} {_number(counts[-2])}')
                lines += [f"{name}_count {_number(counts[-2])}", f"{name}_sum {counts[-1]!r}"]
        for name, samples in flatten(gauges).items():
            lines += [f"# TYPE {name} gauge"]
            lines += [f"{name}{_labels(k)} {_number(v)}" for k, v in sorted(samples.items())]
        return "\n".join(lines) + "\n"


def flatten(
    values: Mapping[str, Any], prefix: str = "", labels: Labels = ()
) -> dict[str, dict[Labels, float]]:
    """Numeric leaves of nested ``values`` as metric samples.

    A mapping under ``tiers`` gives the label ``tier``; other nesting joins names.

    >>> flatten({"store": {"hits": 2, "tiers": {"disk": {"hits": 1}}}})
    {'store_hits': {(): 2.0}, 'store_tier_hits': {(('tier', 'disk'),): 1.0}}
    """
    out: dict[str, dict[Labels, float]] = defaultdict(dict)
    for key, value in values.items():
        name = _NAME.sub("_", f"{prefix}_{key}" if prefix else key)
        if isinstance(value, Mapping):
            if key == "tiers":
                for tier, counts in value.items():
                    if isinstance(counts, Mapping):
                        tier_labels = (*labels, ("tier", str(tier)))
                        for k, v in flatten(counts, f"{prefix}_tier", tier_labels).items():
                            out[k].update(v)
            else:
                for k, v in flatten(value, name, labels).items():
                    out[k].update(v)
        elif isinstance(value, bool | int | float):
            out[name][labels] = float(value)
    return dict(out)


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    escaped = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in labels)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(labels, escaped, strict=True)) + "}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))

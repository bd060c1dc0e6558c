"""``chunkcache bench rag``: every system replays the same RAG requests, side by side.

A system is a generator (Hugging Face ``generate``, or the engine with one recompute
policy) inside one of the two LangChain apps of :mod:`.rag_chains` (``plain`` or
``chunkcache`` layout).  Each system gets its own :class:`ChunkCache` and KV store, so
what one computed never serves another, and replays every request of the workload
through ``chain.invoke`` exactly as an app would.  Systems run one after another (their
KV is freed in between); each records the CPU other processes used meanwhile.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from chunkcache.core.bench.hf_backend import HFGenerateBackend
from chunkcache.core.bench.policies import FULL, POLICY_RUNS, PolicyRun
from chunkcache.core.bench.rag_chains import LAYOUTS, Layout, RetrievedChunks, rag_chain
from chunkcache.core.bench.rag_workload import BenchRequest, Workload
from chunkcache.core.bench.report import CpuMeter
from chunkcache.core.cache import ChunkCache
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.generation import DEFAULT_RECOMPUTE_RATIO, Backend
from chunkcache.core.kv_store import MemoryKVStore
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel

Generator = Literal["engine", "hf"]
Progress = Callable[[str], None]
# Each engine system keeps a bounded store and few conversations: 15 systems share 24 GiB.
DEFAULT_STORE_MIB = 512
MAX_CONVERSATIONS = 8


@dataclass(frozen=True)
class System:
    """A generator with its policy, inside one app layout."""

    name: str
    generator: Generator
    run: PolicyRun
    layout: Layout


def default_systems() -> list[System]:
    """HF ``generate`` in the plain app, and the engine with every policy in both apps."""
    systems = [System("hf generate / plain", "hf", FULL, "plain")]
    for layout in LAYOUTS:
        systems += [System(f"{r.name} / {layout}", "engine", r, layout) for r in POLICY_RUNS]
    return systems


def select_systems(names: Sequence[str] | None) -> list[System]:
    """The default systems, or those named (exact names, or a policy name for all layouts)."""
    systems = default_systems()
    if not names:
        return systems
    chosen = [s for s in systems if s.name in names or s.run.name in names]
    unknown = set(names) - {s.name for s in chosen} - {s.run.name for s in chosen}
    if unknown:
        known = ", ".join(s.name for s in systems)
        raise ValueError(f"unknown systems {sorted(unknown)}; known: {known}")
    return chosen


@dataclass
class Record:
    """What one request returned on one system."""

    request: int  # index into the workload's requests
    answer: str
    chunk_ids: list[str]  # the chunks the retriever put in the prompt, in order
    stats: dict[str, Any]  # response_metadata["chunkcache"]


def make_backend(system: System, lm: LoadedModel, store_mib: int) -> Backend:
    if system.generator == "hf":
        return HFGenerateBackend(lm)
    store = MemoryKVStore(capacity_bytes=store_mib * 2**20)
    return LocalBackend(ChunkEngine(lm, store, max_conversations=MAX_CONVERSATIONS))


def replay(
    system: System,
    lm: LoadedModel,
    workload: Workload,
    max_tokens: int,
    store_mib: int = DEFAULT_STORE_MIB,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run every request of ``workload`` on ``system``: its records and the CPU share."""
    from chunkcache.integrations.langchain import ChunkCacheLLM

    cache = ChunkCache(backend=make_backend(system, lm, store_mib))
    ratio = system.run.ratio if system.run.ratio is not None else DEFAULT_RECOMPUTE_RATIO
    llm = ChunkCacheLLM(
        chunk_cache=cache,
        recompute=system.run.policy,
        recompute_ratio=ratio,
        max_tokens=max_tokens,
    )
    chain = rag_chain(system.layout, llm, workload.retriever(), cache)
    meter = CpuMeter()
    records = []
    for index, request in enumerate(workload.requests):
        records.append(ask(chain, index, request))
        if progress is not None:
            ttft = records[-1].stats["ttft_s"]
            progress(f"{system.name}: {index + 1}/{len(workload.requests)} TTFT {ttft:.2f} s")
    cpu = meter.share()
    del chain, llm, cache
    gc.collect()
    return {"records": records, "cpu": cpu}


def ask(chain: Any, index: int, request: BenchRequest) -> Record:
    spy = RetrievedChunks()
    config = {"configurable": {"session_id": request.conversation_id}, "callbacks": [spy]}
    message = chain.invoke({"question": request.question}, config=config)
    return Record(
        index, str(message.content), spy.chunk_ids, dict(message.response_metadata["chunkcache"])
    )


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)

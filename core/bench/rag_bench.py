"""``chunkcache bench rag``: every system replays the same RAG requests, side by side.

A system is a generator (Hugging Face ``generate``, the engine with one recompute
policy, or a vLLM server with prefix caching off or on) inside one of the two LangChain
apps of :mod:`.rag_chains` (``plain`` or ``chunkcache`` layout).  Each system gets its
own :class:`ChunkCache` and KV store (vLLM: a server whose prefix cache was emptied,
restarted only when prefix caching is switched), so what one computed never serves
another, and replays every request of the workload through ``chain.invoke`` exactly as
an app would.  Systems run one after another (their KV is freed in between); each
records the CPU other processes used meanwhile.  After an engine system's replay,
untimed, :mod:`.rag_quality` scores its logits on a sample of the prompts it was sent.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from langchain_core.runnables import Runnable

from chunkcache.core.bench.hf_backend import HFGenerateBackend
from chunkcache.core.bench.policies import FULL, POLICY_RUNS, PolicyRun
from chunkcache.core.bench.rag_chains import LAYOUTS, Layout, RetrievedChunks, rag_chain
from chunkcache.core.bench.rag_quality import NOT_SCORED, RagQualityScorer, RecordingBackend
from chunkcache.core.bench.rag_workload import BenchRequest, Workload
from chunkcache.core.bench.report import CpuMeter
from chunkcache.core.cache import ChunkCache
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.generation import DEFAULT_RECOMPUTE_RATIO, Backend
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore
from chunkcache.core.vllm_server import VllmServerConfig, VllmServerSlot

Generator = Literal["engine", "hf", "vllm"]
Progress = Callable[[str], None]
# Each engine system keeps a bounded host tier and few conversations: 15 systems share
# 24 GiB.  What the host tier evicts moves to a disk tier of its own (a temporary folder).
DEFAULT_STORE_MIB = 512
DISK_MIB = 4096
MAX_CONVERSATIONS = 8


@dataclass(frozen=True)
class System:
    """A generator with its policy, inside one app layout."""

    name: str
    generator: Generator
    run: PolicyRun
    layout: Layout


# vLLM's policy is its prefix caching: "full" runs the server with it off, "prefix" on.
VLLM_PREFIX = PolicyRun("prefix", "prefix")
VLLM_SYSTEMS = (
    System("vLLM prefix caching off / plain", "vllm", FULL, "plain"),
    System("vLLM prefix caching on / plain", "vllm", VLLM_PREFIX, "plain"),
    System("vLLM prefix caching on / chunkcache", "vllm", VLLM_PREFIX, "chunkcache"),
)


def default_systems() -> list[System]:
    """HF ``generate`` in the plain app, the engine with every policy in both apps, and
    vLLM (when ``make vllm`` installed it) with prefix caching off, on, and on in the
    chunkcache app."""
    from chunkcache.core.vllm_server import vllm_installed

    systems = [System("hf generate / plain", "hf", FULL, "plain")]
    for layout in LAYOUTS:
        systems += [System(f"{r.name} / {layout}", "engine", r, layout) for r in POLICY_RUNS]
    return systems + (list(VLLM_SYSTEMS) if vllm_installed() else [])


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


@contextlib.contextmanager
def system_backend(
    system: System, lm: LoadedModel, store_mib: int, vllm: VllmServerSlot | None = None
) -> Iterator[Backend]:
    """The system's backend: for the engine, on a fresh tiered store (host over disk); for
    vLLM, on ``vllm``'s server (prefix cache emptied), or on a throwaway server when none
    is given."""
    if system.generator == "vllm":
        from chunkcache.integrations.vllm import VllmBackend

        config = VllmServerConfig(
            prefix_caching=system.run.policy == "prefix", threads=os.cpu_count()
        )
        with contextlib.ExitStack() as owned:
            slot = vllm if vllm is not None else owned.enter_context(VllmServerSlot())
            server = slot.server(config)
            backend = VllmBackend(server.base_url, server.model, tokenizer=lm.tokenizer)
            try:
                yield backend
            finally:
                backend.close()
    elif system.generator == "hf":
        yield HFGenerateBackend(lm)
    else:
        with tempfile.TemporaryDirectory(prefix="chunkcache-bench-") as folder:
            store = TieredKVStore(
                [MemoryTier("host", store_mib * 2**20), DiskTier(folder, DISK_MIB * 2**20)]
            )
            try:
                yield LocalBackend(ChunkEngine(lm, store, max_conversations=MAX_CONVERSATIONS))
            finally:
                store.close()


def system_chain(
    system: System, backend: Backend, workload: Workload, max_tokens: int
) -> Runnable[dict[str, Any], Any]:
    """The system's LangChain app on ``backend``, with a fresh :class:`ChunkCache`."""
    from chunkcache.integrations.langchain import ChunkCacheLLM

    cache = ChunkCache(backend=backend)
    ratio = system.run.ratio if system.run.ratio is not None else DEFAULT_RECOMPUTE_RATIO
    llm = ChunkCacheLLM(
        chunk_cache=cache,
        recompute=system.run.policy,
        recompute_ratio=ratio,
        max_tokens=max_tokens,
    )
    return rag_chain(system.layout, llm, workload.retriever(), cache)


def replay(
    system: System,
    lm: LoadedModel,
    workload: Workload,
    max_tokens: int,
    store_mib: int = DEFAULT_STORE_MIB,
    progress: Progress | None = None,
    scorer: RagQualityScorer | None = None,
    scored: Sequence[int] = (),
    vllm: VllmServerSlot | None = None,
) -> dict[str, Any]:
    """Run every request of ``workload`` on ``system``: its records and the CPU share;
    then, untimed, ``scorer``'s quality of the ``scored`` requests (engine systems).
    A vLLM system runs on ``vllm``'s server when given."""
    with system_backend(system, lm, store_mib, vllm) as backend:
        recording = RecordingBackend(backend)
        chain = system_chain(system, recording, workload, max_tokens)
        result = replay_chain(system.name, chain, workload, progress)
        del chain
        if not isinstance(backend, LocalBackend):
            result["quality"] = {"n/a": NOT_SCORED[system.generator]}
        elif scorer is not None:
            if len(recording.requests) != len(workload.requests):
                raise RuntimeError(
                    f"{system.name} sent {len(recording.requests)} prompts for "
                    f"{len(workload.requests)} requests: cannot pair them for scoring"
                )
            store, fingerprint = backend.engine.store, backend.engine.lm.fingerprint
            result["quality"] = scorer.score_system(recording.requests, scored, store, fingerprint)
            if progress is not None:
                progress(
                    f"{system.name}: quality of {len(scored)} requests in "
                    f"{result['quality']['scoring_s']:.0f} s"
                )
    gc.collect()  # frees the system's KV before the next system runs
    return result


def replay_chain(
    name: str,
    chain: Runnable[dict[str, Any], Any],
    workload: Workload,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Ask ``chain`` every request of ``workload`` in order: records and the CPU share."""
    meter = CpuMeter()
    records = []
    for index, request in enumerate(workload.requests):
        records.append(ask(chain, index, request))
        if progress is not None:
            ttft = records[-1].stats["ttft_s"]
            progress(f"{name}: {index + 1}/{len(workload.requests)} TTFT {ttft:.2f} s")
    cpu = meter.share()
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

"""``chunkcache bench ...``: the benchmark subcommands."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chunkcache.core.corpus import DEFAULT_CHUNK_CHARS, MIN_CHUNK_CHARS
from chunkcache.core.paths import user_path

REPORTS = "docs/benchmarks"  # --out's default, a string so that argparse checks it as well
CONVERSATIONS = "multi-turn conversations in the workload"


def bounded_int(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``minimum`` (and at most ``maximum``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f"at least {minimum}" if maximum is None else f"{minimum} to {maximum}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse


POSITIVE = bounded_int(1)
SEED = bounded_int(0, 2**64 - 1)  # the seeds torch.manual_seed takes that are not negative


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def existing_dir(text: str) -> Path:
    """An argparse ``type``: a directory that exists."""
    return _existing(text, Path.is_dir, "a directory")


def existing_file(text: str) -> Path:
    """An argparse ``type``: a file that exists."""
    return _existing(text, Path.is_file, "a file")


def _existing(text: str, check: Callable[[Path], bool], what: str) -> Path:
    path = user_path(text)
    if not check(path):
        problem = f"is not {what}" if path.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{path} {problem}")
    return path


def report_dir(text: str) -> Path:
    """An argparse ``type``: a folder the reports can be written to, or one that can be made
    (so a run does not end with its reports unwritable)."""
    path = user_path(text)
    nearest = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not nearest.is_dir():
        problem = "is a file, not a folder" if nearest == path else f"is under a file, {nearest}"
        raise argparse.ArgumentTypeError(f"{path} {problem}")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{path}: {nearest} is not writable")
    return path


def _file_stem(text: str) -> str:
    """An argparse ``type``: a file name without a folder (a report's name)."""
    if text in ("", ".", "..") or Path(text).name != text or "\\" in text:
        raise argparse.ArgumentTypeError(f"must be a file name without a folder, got {text!r}")
    return text


def _system_name(text: str) -> str:
    """An argparse ``type``: a ``bench rag`` system, or a policy (its systems in every app)."""
    from chunkcache.core.bench.rag_bench import select_systems

    try:
        select_systems([text])
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _engine(args: argparse.Namespace) -> None:
    from chunkcache.core.bench.engine_bench import PARTS, EngineBenchConfig, run_engine_bench

    config = EngineBenchConfig(
        prompts=8 if args.quick else args.prompts,
        seed=args.seed,
        rounds=1 if args.quick else args.rounds,
        answer_tokens=args.answer_tokens,
        parts=PARTS if args.part == "all" else (args.part,),
        out=args.out,
    )
    command = shlex.join(["chunkcache", *sys.argv[1:]])
    run_engine_bench(config, command)
    print((config.out / "engine.md").read_text())


def _rag(args: argparse.Namespace) -> None:
    from chunkcache.core.bench.rag_bench import log
    from chunkcache.core.bench.rag_run import RagBenchConfig, check_config, quick, run_rag_bench

    config = RagBenchConfig(
        conversations=args.conversations,
        min_turns=1 if args.single_turn else args.min_turns,
        max_turns=1 if args.single_turn else args.max_turns,
        gold_questions=args.gold_questions,
        k=args.k,
        chunk_chars=args.chunk_chars,
        max_tokens=args.max_tokens,
        rate=args.rate,
        seed=args.seed,
        systems=tuple(args.system or ()),
        store_mib=args.store_mib,
        corpus_dir=args.corpus_dir,
        chroma=tuple(args.chroma) if args.chroma else None,
        questions=args.questions,
        out=args.out,
        name=args.name,
    )
    if args.quick:
        config = quick(config)
    check_config(config)  # before run_rag_bench loads anything
    run_rag_bench(config, shlex.join(["chunkcache", *sys.argv[1:]]), log)
    print((config.out / f"{config.name}.md").read_text())


def _store(args: argparse.Namespace) -> None:
    from chunkcache.core.bench.engine_bench import log
    from chunkcache.core.bench.store_bench import StoreBenchConfig, quick, run_store_bench

    config = StoreBenchConfig(
        conversations=args.conversations,
        k=args.k,
        prompts=args.prompts,
        rounds=args.rounds,
        seed=args.seed,
        out=args.out,
    )
    if args.quick:
        config = quick(config)
    run_store_bench(config, shlex.join(["chunkcache", *sys.argv[1:]]), log)
    print((config.out / "store.md").read_text())


def _vllm(args: argparse.Namespace) -> None:
    from chunkcache.core.bench.rag_bench import log
    from chunkcache.core.bench.vllm_bench import VllmBenchConfig, quick, run_vllm_bench

    config = VllmBenchConfig(
        conversations=args.conversations, gold_questions=args.gold_questions, out=args.out
    )
    run_vllm_bench(
        quick(config) if args.quick else config, shlex.join(["chunkcache", *sys.argv[1:]]), log
    )
    print((config.out / f"{config.name}.md").read_text())


def add_bench_parser(commands: Any) -> None:
    """Add ``bench`` and its subcommands to the ``chunkcache`` parser's ``commands``."""
    bench = commands.add_parser("bench", help="run a benchmark").add_subparsers(
        dest="bench_command", required=True
    )
    engine = bench.add_parser(
        "engine", help="recompute policies vs full prefill: quality (float32) and TTFT (bf16)"
    )
    engine.add_argument("--prompts", type=POSITIVE, default=50, help="RAG prompts")
    engine.add_argument("--quick", action="store_true", help="8 prompts, 1 round (smoke test)")
    engine.add_argument("--seed", type=SEED, default=0, help="seed of the prompts")
    engine.add_argument("--rounds", type=POSITIVE, default=3, help="timed rounds per prompt")
    engine.add_argument(
        "--answer-tokens", type=POSITIVE, default=32, help="tokens generated per prompt"
    )
    # engine_bench.PARTS, spelled out so the parser does not import torch
    parts = ("all", "quality", "quality-reordered", "speed")
    engine.add_argument("--part", choices=parts, default="all", help="what to measure")
    engine.add_argument("--out", type=report_dir, default=REPORTS, help="report folder")
    engine.set_defaults(run=_engine)
    _add_rag_parser(bench)
    _add_store_parser(bench)
    vllm = bench.add_parser(
        "vllm", help="vLLM prefix caching: chunkcache's layout vs plain LangChain, side by side"
    )
    vllm.add_argument("--quick", action="store_true", help="a few requests, eager vLLM")
    vllm.add_argument("--conversations", type=POSITIVE, default=24, help=CONVERSATIONS)
    vllm.add_argument(
        "--gold-questions", type=bounded_int(0), default=48, help="0: no gold workload"
    )
    vllm.add_argument("--out", type=report_dir, default=REPORTS, help="report folder")
    vllm.set_defaults(run=_vllm)
    _add_summary_parser(bench)
    try:
        from chunkcache.core.serve.loadtest_run import add_bench_serve_parser
    except ModuleNotFoundError as missing:  # no server extra: the rest of the CLI still works
        _add_unavailable_parser(bench, "serve", missing)
    else:
        add_bench_serve_parser(bench)


def _add_unavailable_parser(bench: Any, name: str, missing: ModuleNotFoundError) -> None:
    """``name`` as a command that raises ``missing`` when run (the CLI says what to install)."""
    parser = bench.add_parser(
        name,
        help=f"(needs {missing.name}, not installed)",
        add_help=False,
        prefix_chars="\0",  # no options: any argument, --flags included, is taken as it is
    )
    parser.add_argument("arguments", nargs="*")

    def refuse(args: argparse.Namespace) -> None:
        raise missing

    parser.set_defaults(run=refuse)


def _add_rag_parser(bench: Any) -> None:
    rag = bench.add_parser(
        "rag", help="every system replays the same RAG workload: TTFT, throughput, quality"
    )
    rag.add_argument("--quick", action="store_true", help="a few requests (smoke test)")
    rag.add_argument("--conversations", type=POSITIVE, default=24, help=CONVERSATIONS)
    rag.add_argument(
        "--min-turns", type=POSITIVE, default=2, help="turns per conversation, at least"
    )
    rag.add_argument(
        "--max-turns", type=POSITIVE, default=5, help="turns per conversation, at most"
    )
    rag.add_argument("--single-turn", action="store_true", help="one turn per conversation")
    rag.add_argument(
        "--gold-questions", type=bounded_int(0), default=48, help="0: no gold workload"
    )
    rag.add_argument("--k", type=POSITIVE, default=5, help="chunks per request")
    rag.add_argument(
        "--chunk-chars",
        type=bounded_int(MIN_CHUNK_CHARS),
        default=DEFAULT_CHUNK_CHARS,
        help="chunk size of the bundled corpus or --corpus-dir, in characters",
    )
    rag.add_argument("--max-tokens", type=POSITIVE, default=32, help="answer tokens")
    rag.add_argument("--rate", type=positive_float, default=0.5, help="Poisson arrivals per second")
    rag.add_argument("--seed", type=SEED, default=0, help="seed of the workload and arrivals")
    rag.add_argument(
        "--system",
        action="append",
        type=_system_name,
        help="run only these (a system or policy name; repeat)",
    )
    rag.add_argument(
        "--store-mib", type=POSITIVE, default=512, help="host tier of the KV store, per system"
    )
    rag.add_argument("--corpus-dir", type=existing_dir, help="your corpus: a folder of text files")
    rag.add_argument("--chroma", nargs=2, metavar=("DIR", "COLLECTION"), help="or Chroma")
    rag.add_argument("--questions", type=existing_file, help="your questions (text or JSON lines)")
    rag.add_argument("--out", type=report_dir, default=REPORTS, help="report folder")
    rag.add_argument("--name", type=_file_stem, default="rag", help="report file stem")
    rag.set_defaults(run=_rag)


def _summary(args: argparse.Namespace) -> None:
    from chunkcache.core.bench.summary import write_summary

    print(write_summary(args.out).read_text())


def _add_summary_parser(bench: Any) -> None:
    summary = bench.add_parser(
        "summary", help="write docs/benchmarks/README.md: every report's findings, read from JSON"
    )
    summary.add_argument("--out", type=existing_dir, default=REPORTS, help="report folder")
    summary.set_defaults(run=_summary)


def _add_store_parser(bench: Any) -> None:
    store = bench.add_parser(
        "store", help="tiered store: hit rate per eviction policy, TTFT with hits per tier"
    )
    store.add_argument("--quick", action="store_true", help="short trace, 2 prompts, 1 round")
    store.add_argument("--conversations", type=POSITIVE, default=200, help="multi-turn trace size")
    store.add_argument("--k", type=POSITIVE, default=5, help="chunks retrieved per turn")
    store.add_argument("--prompts", type=POSITIVE, default=10, help="TTFT prompts")
    store.add_argument("--rounds", type=POSITIVE, default=3, help="timed rounds per prompt")
    store.add_argument("--seed", type=SEED, default=0, help="seed of the trace and prompts")
    store.add_argument("--out", type=report_dir, default=REPORTS, help="report folder")
    store.set_defaults(run=_store)

"""``chunkcache bench ...``: the benchmark subcommands."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any


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


def add_bench_parser(commands: Any) -> None:
    """Add ``bench`` and its subcommands to the ``chunkcache`` parser's ``commands``."""
    bench = commands.add_parser("bench", help="run a benchmark").add_subparsers(
        dest="bench_command", required=True
    )
    engine = bench.add_parser(
        "engine", help="recompute policies vs full prefill: quality (float32) and TTFT (bf16)"
    )
    engine.add_argument("--prompts", type=int, default=50)
    engine.add_argument("--quick", action="store_true", help="8 prompts, 1 round (smoke test)")
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--rounds", type=int, default=3, help="timed rounds per prompt")
    engine.add_argument("--answer-tokens", type=int, default=32)
    engine.add_argument("--part", choices=("all", "quality", "speed"), default="all")
    engine.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="report folder")
    engine.set_defaults(run=_engine)

"""The ``chunkcache`` command line.

chunkcache models pull [PATH]   install the default model (or check a local one)
chunkcache bench engine         recompute policies against full prefill (see --help)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from chunkcache.core.bench.cli import add_bench_parser


def _models_pull(args: argparse.Namespace) -> None:
    from chunkcache.core.model_files import pull_default_model
    from chunkcache.core.models import load_model

    path = args.path or pull_default_model()
    lm = load_model(path)
    spec = lm.spec
    print(f"{path}: {spec.architecture}, {spec.num_layers} layers, fingerprint {lm.fingerprint}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chunkcache", description="Chunk-KV cache for RAG.")
    commands = parser.add_subparsers(dest="command", required=True)
    models = commands.add_parser("models", help="manage models").add_subparsers(
        dest="models_command", required=True
    )
    pull = models.add_parser("pull", help="install the default model, or check one by path")
    pull.add_argument("path", nargs="?", help="a local checkpoint directory or GGUF file")
    pull.set_defaults(run=_models_pull)
    add_bench_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()

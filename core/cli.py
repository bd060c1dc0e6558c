"""The ``chunkcache`` command line.

chunkcache models pull [PATH]   install the default model (or check a local one)
chunkcache bench engine         recompute policies against full prefill (see --help)
chunkcache warm [--folder DIR]  precompute chunk KV into the store's disk tier (resumable)
chunkcache serve [--port P]     an OpenAI-compatible server over the engine (docs/serve.md)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from chunkcache.core.bench.cli import add_bench_parser


def _models_pull(args: argparse.Namespace) -> None:
    from chunkcache.core.model_files import pull_default_model
    from chunkcache.core.models import load_model

    path = args.path or pull_default_model()
    lm = load_model(path)
    spec = lm.spec
    print(f"{path}: {spec.architecture}, {spec.num_layers} layers, fingerprint {lm.fingerprint}")


def _warm(args: argparse.Namespace) -> None:
    import torch

    from chunkcache.core.engine import ChunkEngine
    from chunkcache.core.models import load_model
    from chunkcache.core.store.settings import StoreSettings
    from chunkcache.core.store.tiered import TieredKVStore
    from chunkcache.core.store.warm import chroma_chunks, corpus_chunks, folder_chunks, warm

    settings = StoreSettings.from_file(args.config) if args.config else StoreSettings()
    if not settings.disk_bytes and not settings.redis_url:
        raise SystemExit("warm needs a disk or Redis tier to keep what it computes")
    if args.folder:
        source = folder_chunks(args.folder, args.chunk_chars)
    elif args.chroma:
        source = chroma_chunks(args.chroma, args.collection)
    else:
        source = corpus_chunks(args.max_chunks)
    chunks = list(source)[: args.max_chunks]
    lm = load_model(args.model, dtype=getattr(torch, args.dtype))
    store = TieredKVStore.from_settings(settings.model_copy(update={"write_through": True}))
    try:
        report = warm(ChunkEngine(lm, store), chunks, args.prefix, args.policy)
    finally:
        store.close()
    print(
        f"warm: {report.computed} chunks computed, {report.skipped} already stored, "
        f"{report.seconds:.1f} s; fingerprint {lm.fingerprint}"
    )


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
    _add_warm_parser(commands)
    _add_serve_parser(commands)
    return parser


def _add_warm_parser(commands: Any) -> None:
    warm = commands.add_parser(
        "warm", help="precompute chunk KV of the bundled corpus or a folder into the store"
    )
    warm.add_argument("--folder", help="a folder of .txt/.md files (default: bundled corpus)")
    warm.add_argument("--chroma", help="a persistent Chroma directory (with --collection)")
    warm.add_argument("--collection", default="langchain", help="the Chroma collection")
    warm.add_argument("--model", help="checkpoint directory or GGUF file (default model)")
    warm.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    warm.add_argument("--prefix", default="", help="text before each chunk (the system prompt)")
    warm.add_argument("--policy", default="full", choices=["full", "cachecraft"])
    warm.add_argument("--chunk-chars", type=int, default=1000, help="chunk size for --folder")
    warm.add_argument("--max-chunks", type=int, default=None, help="warm at most this many")
    warm.add_argument("--config", help="store settings file (.toml/.json)")
    warm.set_defaults(run=_warm)


def _serve(args: argparse.Namespace) -> None:
    from chunkcache.core.serve import ServeSettings, run_server

    given = {"host": args.host, "port": args.port, "model": args.model}
    run_server(ServeSettings(**{k: v for k, v in given.items() if v is not None}))


def _add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server (more settings: CHUNKCACHE_SERVE_* env)"
    )
    serve.add_argument("--host", help="interface (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="TCP port (default 8000)")
    serve.add_argument("--model", help="checkpoint directory or GGUF file (default model)")
    serve.set_defaults(run=_serve)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()

"""The ``chunkcache`` command line.

chunkcache models pull [PATH]   install the default model (or check a local one)
chunkcache bench engine         recompute policies against full prefill (see --help)
chunkcache warm [--folder DIR]  precompute chunk KV into the store's disk tier (resumable)
chunkcache serve [--port P]     an OpenAI-compatible server over the engine (docs/serve.md)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import errno
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkcache.core.bench.cli import (
    POSITIVE,
    add_bench_parser,
    bounded_int,
    existing_dir,
    existing_file,
)
from chunkcache.core.corpus import DEFAULT_CHUNK_CHARS, MIN_CHUNK_CHARS
from chunkcache.core.errors import ChunkCacheError, UsageError

if TYPE_CHECKING:
    from chunkcache.core.store.settings import StoreSettings

DEFAULT_COLLECTION = "langchain"  # what langchain-chroma names a collection it is not told


def _model_path(text: str) -> str:
    """An argparse ``type``: a checkpoint path or model name, not empty (which would name
    the current folder, or for ``models pull`` the default model)."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (leave it out for the default model)")
    return text


def _models_pull(args: argparse.Namespace) -> None:
    from chunkcache.core.model_files import pull_default_model
    from chunkcache.core.models import load_model

    path = args.path if args.path is not None else pull_default_model()
    lm = load_model(path)
    spec = lm.spec
    print(f"{path}: {spec.architecture}, {spec.num_layers} layers, fingerprint {lm.fingerprint}")


def _warm(args: argparse.Namespace) -> None:
    import torch

    from chunkcache.core.corpus import load_corpus
    from chunkcache.core.engine import ChunkEngine
    from chunkcache.core.models import load_model
    from chunkcache.core.store.tiered import TieredKVStore
    from chunkcache.core.store.warm import check_keeps_writes, warm
    from chunkcache.core.user_corpus import load_chroma_corpus, load_text_folder

    if args.collection is not None and args.chroma is None:
        raise UsageError("--collection names a collection of --chroma DIR: add --chroma")
    settings = _store_settings(args.config)
    if not settings.disk_bytes and not settings.redis_url:
        raise UsageError("warm needs a disk or Redis tier to keep what it computes")
    if args.folder:  # the chunks `bench rag --corpus-dir` / `--chroma` retrieve
        chunks = load_text_folder(args.folder, args.chunk_chars)[: args.max_chunks]
    elif args.chroma:
        collection = args.collection if args.collection is not None else DEFAULT_COLLECTION
        chunks = load_chroma_corpus(args.chroma, collection)[: args.max_chunks]
    else:
        chunks = load_corpus(args.chunk_chars, args.max_chunks)
    store = TieredKVStore.from_settings(settings.model_copy(update={"write_through": True}))
    try:
        check_keeps_writes(store)  # before the model loads
        lm = load_model(args.model, dtype=getattr(torch, args.dtype))
        report = warm(ChunkEngine(lm, store), chunks, args.prefix, args.policy)
    finally:
        store.close()
    print(
        f"warm: {report.computed} chunks computed, {report.skipped} already stored, "
        f"{report.seconds:.1f} s; fingerprint {lm.fingerprint}"
    )


def _store_settings(config: Path | None) -> StoreSettings:
    """The store settings, read from ``config`` if given, else from the file
    ``CHUNKCACHE_STORE_CONFIG`` names if set (a UsageError naming either when it cannot be
    read as settings)."""
    from chunkcache.core.store.settings import StoreSettings

    return StoreSettings() if config is None else StoreSettings.from_file(config)


class _HelpWithDefaults(argparse.HelpFormatter):
    """Help that states every option's default (options without a help text too), unless
    it is None, empty or a flag's False."""

    def add_argument(self, action: argparse.Action) -> None:
        default = action.default
        shown = not (default is None or default is False or default in ("", argparse.SUPPRESS))
        if shown and action.option_strings and action.help != argparse.SUPPRESS:
            help_text = action.help or ""
            if "%(default)" not in help_text:
                action = copy.copy(action)
                action.help = f"{help_text} (default: %(default)s)".lstrip()
        super().add_argument(action)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help, and its subcommands' help, states defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpWithDefaults)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The ``chunkcache`` parser, its subcommands and their options."""
    parser = _Parser(prog="chunkcache", description="Chunk-KV cache for RAG.")
    commands = parser.add_subparsers(dest="command", required=True)
    models = commands.add_parser("models", help="manage models").add_subparsers(
        dest="models_command", required=True
    )
    pull = models.add_parser("pull", help="install the default model, or check one by path")
    pull.add_argument(
        "path", nargs="?", type=_model_path, help="a local checkpoint directory or GGUF file"
    )
    pull.set_defaults(run=_models_pull)
    add_bench_parser(commands)
    _add_warm_parser(commands)
    _add_serve_parser(commands)
    return parser


def _add_warm_parser(commands: Any) -> None:
    warm = commands.add_parser(
        "warm",
        help="precompute chunk KV of the bundled corpus, a folder or a Chroma collection into "
        "the store",
    )
    source = warm.add_mutually_exclusive_group()
    source.add_argument(
        "--folder", type=existing_dir, help="a folder of .txt/.md files (default: bundled corpus)"
    )
    source.add_argument(
        "--chroma", type=existing_dir, help="a persistent Chroma directory (with --collection)"
    )
    warm.add_argument(
        "--collection", help=f"the collection of --chroma (default: {DEFAULT_COLLECTION})"
    )
    warm.add_argument(
        "--model", type=_model_path, help="checkpoint directory or GGUF file (default model)"
    )
    warm.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32", "float16"],
        help="model dtype",
    )
    warm.add_argument("--prefix", default="", help="text before each chunk (the system prompt)")
    warm.add_argument(
        "--policy",
        default="full",
        choices=["full", "cachecraft"],
        help="cachecraft: also measure the metadata its serving policy needs",
    )
    warm.add_argument(
        "--chunk-chars",
        type=bounded_int(MIN_CHUNK_CHARS),
        default=DEFAULT_CHUNK_CHARS,
        help="chunk size of the bundled corpus or --folder, in characters (as bench rag's)",
    )
    warm.add_argument("--max-chunks", type=POSITIVE, help="warm at most this many")
    warm.add_argument("--config", type=existing_file, help="store settings file (.toml/.json)")
    warm.set_defaults(run=_warm)


def _serve(args: argparse.Namespace) -> None:
    from chunkcache.core.serve import ServeSettings, run_server

    given = {"host": args.host, "port": args.port, "model": args.model}
    settings = ServeSettings(**{k: v for k, v in given.items() if v is not None})
    _check_can_listen(settings.host, settings.port)  # before the model loads, not after
    run_server(settings)


# Errors for an address of a family this machine lacks, which asyncio skips:
_FAMILY_NOT_HERE = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)


def _check_can_listen(host: str, port: int) -> None:
    """:class:`UsageError` unless ``host:port`` can be bound now (a port in use, a host that
    does not resolve or is not this machine's), each address bound as asyncio binds it."""
    problem = f"cannot listen on {host}:{port}"
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as error:
        raise UsageError(f"{problem}: {error.strerror}") from error
    skipped: list[OSError] = []
    for family, kind, proto, _, address in addresses:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
        except OSError as error:
            if error.errno not in _FAMILY_NOT_HERE:
                raise UsageError(f"{problem}: {error.strerror}") from error
            skipped.append(error)
    if skipped and len(skipped) == len(addresses):  # none bound
        raise UsageError(f"{problem}: {skipped[0].strerror}")


def _add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server (more settings: CHUNKCACHE_SERVE_* env)"
    )
    serve.add_argument("--host", help="interface (default 127.0.0.1)")
    serve.add_argument("--port", type=bounded_int(0, 65535), help="TCP port (default 8000)")
    serve.add_argument(
        "--model", type=_model_path, help="checkpoint directory or GGUF file (default model)"
    )
    serve.set_defaults(run=_serve)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command ``argv`` names; a user's mistake exits with one line (2 from argparse,
    else 1), a bug with its traceback.  Ctrl-C exits quietly with 130; output piped into a
    reader that stops early (``| head``) ends it quietly with 1 (Python's "Note on SIGPIPE").
    SIGTERM (``kill``, a CI timeout) exits with 143 through the same clean-up as Ctrl-C, so a
    vLLM or Redis server a command started is stopped, not left running in its own session."""
    try:
        try:
            with _sigterm_exits():
                _run(argv)
        finally:
            sys.stdout.flush()  # a broken pipe shows here, not at interpreter exit
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except BrokenPipeError:
        # Python flushes stdout again on exit: point it at devnull so that is quiet too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(1) from None


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) while inside (Python's default ends the process
    without unwinding); the handler before is put back after.  Main thread only, where
    Python runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _run(argv: Sequence[str] | None) -> None:
    """Parse ``argv`` and run its command; a user's mistake is one line and exit 1."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except Exception as error:
        if not _caused_by_user(error):
            raise
        print(f"{parser.prog}: error: {_one_line(error)}", file=sys.stderr)
        raise SystemExit(1) from None


def _caused_by_user(error: Exception) -> bool:
    """What a user causes: chunkcache's own errors (ModelLoadError and UsageError among
    them), settings pydantic refuses, and a file named that cannot be used.  Anything
    else, a plain ValueError included, is a bug and keeps its traceback."""
    if isinstance(error, ChunkCacheError) or _missing_extra(error) is not None:
        return True
    if isinstance(error, OSError):
        return error.filename is not None
    return _as_validation_error(error) is not None


def _as_validation_error(error: Exception) -> Any:
    """``error`` if it is pydantic's ValidationError (refused settings), else None."""
    pydantic_core = sys.modules.get("pydantic_core")  # imported if it raised the error
    is_one = pydantic_core is not None and isinstance(error, pydantic_core.ValidationError)
    return error if is_one else None


def _one_line(error: Exception) -> str:
    """``error``'s message: a pydantic validation error field by field, an OS error with its
    path."""
    if (invalid := _as_validation_error(error)) is not None:
        fields = (
            f"{'.'.join(map(str, e['loc']))}={e['input']!r}: {e['msg']}"
            for e in invalid.errors(include_url=False)
        )
        return f"invalid {invalid.title}: " + "; ".join(fields)
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.filename}: {error.strerror}"
    if isinstance(error, ModuleNotFoundError) and (extra := _missing_extra(error)) is not None:
        return f"this command needs {error.name}, not installed: pip install 'chunkcache[{extra}]'"
    return str(error)


# The extra (pyproject.toml) that installs each optional module a command may import.
_EXTRA_OF = {
    **dict.fromkeys(("torch", "transformers", "gguf", "accelerate", "safetensors"), "engine"),
    **dict.fromkeys(("numpy", "filelock", "pydantic", "pydantic_settings", "tqdm"), "engine"),
    **dict.fromkeys(("fastapi", "starlette", "uvicorn", "httpx", "anyio", "psutil"), "server"),
    **dict.fromkeys(("langchain_core", "langchain_chroma", "chromadb"), "langchain"),
    "llama_index": "llama-index",
    **dict.fromkeys(("faiss", "sentence_transformers"), "vectorstores"),
    "redis": "redis",
    "matplotlib": "bench",
}


def _missing_extra(error: Exception) -> str | None:
    """The extra to install when ``error`` is a module of one that is not installed."""
    if not isinstance(error, ModuleNotFoundError) or not error.name:
        return None
    return _EXTRA_OF.get(error.name.split(".")[0])


if __name__ == "__main__":
    main()

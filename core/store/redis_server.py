"""A throwaway ``redis-server`` on a free loopback port, for tests and benchmarks.

Started from Debian's ``redis-server`` binary with no persistence in a folder of the
caller's; killed on exit.  Production deployments point ``redis_url`` at their own server.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server")


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def redis_server(
    folder: Path, port: int | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start ``redis-server`` (which must be installed) on ``port`` (default: a free one):
    its url and process.  A server started again on a stopped one's port is the same url."""
    if REDIS_SERVER is None:
        raise FileNotFoundError("redis-server is not installed (Debian package redis-server)")
    port = free_port() if port is None else port
    args = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    args += ["--appendonly", "no", "--dir", str(folder)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        proc.kill()
        proc.wait()

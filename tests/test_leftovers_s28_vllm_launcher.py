"""The vLLM launcher picks a free port, then starts vLLM on it: another process can take the
port in between.  The launcher must then not take that other server for its vLLM (even one
serving the same model under the same name, as another session's launcher would) but start
again on a new port, a bounded number of times.  vLLM is replaced by a small HTTP server
started as vLLM would be, which fails as vLLM does when its port is taken."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from chunkcache.core import vllm_server as module
from chunkcache.core.errors import ChunkCacheError
from chunkcache.core.serve.launcher import serve_app
from chunkcache.core.vllm_server import VllmServerConfig, vllm_server

# Binds --port as vLLM does (before anything else: a taken port ends it with vLLM's
# "OSError: [Errno 98] Address already in use"), then answers /health and /v1/models with
# every --served-model-name, its --model as root, and its pid.
FAKE_VLLM = """
import argparse, http.server, json, os

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int)
parser.add_argument("--model")
parser.add_argument("--served-model-name", nargs="+")
parser.add_argument("--max-model-len", type=int)
args, _ = parser.parse_known_args()
if args.max_model_len == 1:
    raise ValueError("max_model_len must be larger than 1")


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path not in ("/health", "/v1/models"):
            self.send_error(404)
            return
        cards = [{"id": name, "root": args.model, "pid": os.getpid()}
                 for name in args.served_model_name]
        body = json.dumps({"data": cards}).encode() if self.path == "/v1/models" else b""
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
"""


class Launches:
    """The ports the launcher is given, in order (the last one again and again), and the
    ports it started the fake vLLM on."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.started: list[int] = []

    def free_port(self) -> int:
        return self.ports.pop(0) if len(self.ports) > 1 else self.ports[0]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    return folder


def launch_fakes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ports: list[int]) -> Launches:
    """Make the launcher run the fake vLLM, on ``ports``."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    launches = Launches(ports)
    real_args = module.server_args

    def fake_args(*args: Any, **kwargs: Any) -> list[str]:
        words = real_args(*args, **kwargs)
        launches.started.append(int(words[words.index("--port") + 1]))
        return [sys.executable, str(script), *words[3:]]  # instead of -m <vLLM's module>

    monkeypatch.setattr(module, "vllm_python", lambda: Path(sys.executable))
    monkeypatch.setattr(module, "server_args", fake_args)
    monkeypatch.setattr(module, "free_port", launches.free_port)
    return launches


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.fixture
def impostor(model: Path) -> Iterator[str]:
    """A server that looks like the launcher's vLLM: same model, same served name."""

    async def health(request: Request) -> Response:
        return PlainTextResponse("")

    async def models(request: Request) -> Response:
        card = {"id": VllmServerConfig().served_name, "root": str(model), "pid": 0}
        return JSONResponse({"data": [card]})

    app = Starlette(routes=[Route("/health", health), Route("/v1/models", models)])
    with serve_app(app) as url:
        yield url


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A port something listens on without ever answering: the launcher's health checks
    time out there, and vLLM cannot bind it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_server_that_took_the_port_is_not_taken_for_vllm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model: Path, impostor: str
) -> None:
    spare = free_port()
    launches = launch_fakes(monkeypatch, tmp_path, [port_of(impostor), spare])
    with vllm_server(VllmServerConfig(model=model)) as server:
        assert server.base_url == f"http://127.0.0.1:{spare}"
        cards = httpx.get(f"{server.base_url}/v1/models").json()["data"]
        assert cards[0]["pid"] == server.process.pid  # its own process answers
        assert cards[0]["id"] == server.model == VllmServerConfig().served_name
        assert server.process.poll() is None
    assert launches.started == [port_of(impostor), spare]
    assert server.process.poll() is not None  # stopped on exit


def test_a_port_taken_by_a_silent_listener_is_left_for_a_new_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model: Path, silent_listener: int
) -> None:
    spare = free_port()
    launches = launch_fakes(monkeypatch, tmp_path, [silent_listener, spare])
    with vllm_server(VllmServerConfig(model=model)) as server:
        assert server.base_url == f"http://127.0.0.1:{spare}"
        assert httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["pid"] == (
            server.process.pid
        )
    assert launches.started == [silent_listener, spare]


def test_a_port_taken_every_time_ends_in_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model: Path, impostor: str
) -> None:
    launches = launch_fakes(monkeypatch, tmp_path, [port_of(impostor)])
    with (
        pytest.raises(ChunkCacheError, match=r"port .*taken .*3 times") as raised,
        vllm_server(VllmServerConfig(model=model)),
    ):
        pass
    assert launches.started == [port_of(impostor)] * 3
    assert impostor in str(raised.value)  # what answered there instead


def test_a_server_that_fails_otherwise_is_not_started_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model: Path
) -> None:
    launches = launch_fakes(monkeypatch, tmp_path, [free_port()])
    with (
        pytest.raises(ChunkCacheError, match="exited with 1: ValueError: max_model_len must"),
        vllm_server(VllmServerConfig(model=model, max_model_len=1)),
    ):
        pass
    assert len(launches.started) == 1

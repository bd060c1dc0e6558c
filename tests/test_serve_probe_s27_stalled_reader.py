"""A streaming client that stops reading: uvicorn's writes have no timeout, so once the
socket's buffers are full the stream waits on the client for as long as the connection lives,
holding its admission place (and, on the local backend, its KV).  A stream its client takes
nothing of for ``SEND_STALL_S`` is cut; one read to its end, however big, is not."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from fake_backend import FakeBackend
from test_serve_cancel import metric

from chunkcache.core.serve import ServeSettings, create_app, streaming
from chunkcache.core.serve.launcher import serve_app

MODEL = FakeBackend.model_name
PIECES = 300  # of 40,000 characters: 12 MB of events, more than loopback's socket buffers
IN_FLIGHT = "chunkcache_in_flight_requests"
CANCELLED = 'chunkcache_generations_total{outcome="cancelled"}'


@pytest.fixture
def url(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    # raising=False: the test runs (and fails) on a server without the timeout too
    monkeypatch.setattr(streaming, "SEND_STALL_S", 1.0, raising=False)
    backend = FakeBackend(" ".join(["x" * 40_000] * PIECES))
    with serve_app(create_app(backend, ServeSettings(max_queue=1, max_batch=1))) as base:
        yield base


def request(max_tokens: int) -> dict[str, object]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "stream": True}


def test_a_client_that_stops_reading_its_stream_gives_its_place_back(url: str) -> None:
    body = json.dumps(request(PIECES)).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    with socket.socket() as stalled:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        stalled.sendall(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        assert stalled.recv(12) == b"HTTP/1.1 200"  # streaming, then never read again
        with httpx.Client(base_url=url, timeout=30) as client:
            for _ in range(300):  # bounded: 30 s
                if metric(client, CANCELLED) == 1:
                    break
                time.sleep(0.1)
            assert metric(client, CANCELLED) == 1
            assert metric(client, IN_FLIGHT) == 0
            # the only two places: one was the stalled stream's
            second = client.post("/v1/completions", json={**request(2), "stream": False})
            assert second.status_code == 200, second.text


def test_a_big_stream_read_to_its_end_is_whole(url: str) -> None:
    with (
        httpx.Client(base_url=url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json=request(PIECES)) as response,
    ):
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    # every event but [DONE] carries text: the last piece's comes with the finish reason
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]]
    assert "".join(texts) == " ".join(["x" * 40_000] * PIECES)

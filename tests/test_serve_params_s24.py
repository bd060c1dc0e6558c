"""What the OpenAI API accepts, ``chunkcache serve`` accepts too: ``top_p`` 0 (only the most
likely token: greedy), a negative ``seed`` (OpenAI's is a signed 64-bit integer; torch seeds
it modulo 2**64) and an empty ``stop`` string (it can match nothing: ignored).  A seed torch
cannot take is a one-line 400 naming ``seed``; ``bench serve --url`` names ``--url``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fake_backend import DEFAULT_ANSWER, FakeBackend
from fastapi.testclient import TestClient
from test_cli import run

from chunkcache.core.generation import GenerationRequest
from chunkcache.core.serve import create_app

MODEL = FakeBackend.model_name
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}
TEXT = {"model": MODEL, "prompt": "hi", "max_tokens": 9}


def post(extra: dict[str, Any], body: dict[str, Any] = CHAT) -> tuple[int, Any, FakeBackend]:
    """Status and JSON of ``body`` plus ``extra`` posted to its route, and the backend."""
    backend = FakeBackend()
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with TestClient(create_app(backend)) as client:
        response = client.post(route, json={**body, **extra})
    return response.status_code, response.json(), backend


def engine_request(extra: dict[str, Any], body: dict[str, Any] = CHAT) -> GenerationRequest:
    status, answer, backend = post(extra, body)
    assert status == 200, answer
    return backend.requests[-1]


@pytest.mark.parametrize("body", [CHAT, TEXT], ids=["chat", "text"])
@pytest.mark.parametrize("temperature", [None, 0.7, 0])
def test_top_p_0_is_greedy(body: dict[str, Any], temperature: float | None) -> None:
    """The nucleus of top_p -> 0 is the most likely token alone: vLLM's 400 here breaks
    clients written for OpenAI, which takes top_p in [0, 1]."""
    sampling = engine_request({"top_p": 0, "temperature": temperature}, body).sampling
    assert (sampling.temperature, sampling.top_p) == (0, 1.0)


def test_a_small_top_p_is_kept_as_it_is() -> None:
    sampling = engine_request({"top_p": 1e-9, "temperature": 0.7}).sampling
    assert (sampling.temperature, sampling.top_p) == (0.7, 1e-9)


@pytest.mark.parametrize("top_p", [-0.1, 1.01])
def test_a_top_p_outside_0_to_1_is_still_refused(top_p: float) -> None:
    status, answer, _ = post({"top_p": top_p})
    assert status == 400 and answer["error"]["param"] == "top_p"


@pytest.mark.parametrize("seed", [-1, -(2**63), -7, 2**63, 2**64 - 1])
def test_a_signed_64_bit_seed_seeds_as_torch_does(seed: int) -> None:
    engine_seed = engine_request({"seed": seed, "temperature": 1}).sampling.seed
    assert engine_seed is not None
    ours = torch.rand(4, generator=torch.Generator().manual_seed(engine_seed))
    torchs = torch.rand(4, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(ours, torchs)


def test_negative_seeds_are_deterministic_and_distinct() -> None:
    first, again, other = (engine_request({"seed": s}).sampling.seed for s in (-5, -5, -6))
    assert first == again != other


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_a_seed_torch_cannot_take_is_one_line_naming_seed(seed: int) -> None:
    status, answer, backend = post({"seed": seed})
    error = answer["error"]
    assert status == 400 and error["param"] == "seed", answer
    message = error["message"]
    assert message.startswith("seed: ") and "\n" not in message
    assert str(-(2**63)) in message and str(2**64 - 1) in message
    assert not backend.requests


@pytest.mark.parametrize("body", [CHAT, TEXT], ids=["chat", "text"])
@pytest.mark.parametrize(
    ("stop", "kept"), [("", ()), ([""], ()), (["", "zz", ""], ("zz",)), (["is", ""], ("is",))]
)
def test_an_empty_stop_string_is_ignored(
    body: dict[str, Any], stop: str | list[str], kept: tuple[str, ...]
) -> None:
    status, answer, backend = post({"stop": stop}, body)
    assert status == 200, answer
    assert tuple(backend.requests[-1].sampling.stop) == kept
    choice = answer["choices"][0]
    text = choice["message"]["content"] if body is CHAT else choice["text"]
    assert text == ("The answer" if "is" in kept else DEFAULT_ANSWER)


def test_stop_still_takes_at_most_16_strings() -> None:
    status, answer, _ = post({"stop": [f"s{i}" for i in range(17)]})
    assert status == 400 and answer["error"]["param"] == "stop"


def test_bench_serve_names_its_url_option(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, err = run(["bench", "serve", "--url", "notaurl", "--out", str(tmp_path)], capsys)
    assert code == 2, err
    assert err[-1].startswith("chunkcache bench serve: error: argument --url: --url must be ")
    assert "base_url" not in err[-1]

"""Both HTTP clients (``chunkcache serve``'s HttpBackend, VllmBackend) check ``base_url`` with
one function: an http(s) URL with a host, ``/v1`` and a trailing ``/`` optional."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from chunkcache.core.http_backend import HttpBackend
from chunkcache.core.urls import server_root
from chunkcache.integrations.vllm import VllmBackend

CLIENTS: dict[str, Callable[[str], Any]] = {
    "http": lambda url: HttpBackend(url, model="m"),
    "vllm": lambda url: VllmBackend(url, "m", tokenizer=object()),
}


@pytest.mark.parametrize("client", sorted(CLIENTS))
@pytest.mark.parametrize(
    "url",
    ["http:///v1", "ftp://x", "localhost:8000", "127.0.0.1:8000", "", "http://", "http://[::1"],
)
def test_a_base_url_without_an_http_scheme_and_a_host_is_refused(client: str, url: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(url))):
        CLIENTS[client](url)


@pytest.mark.parametrize("client", sorted(CLIENTS))
@pytest.mark.parametrize(
    ("url", "root"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
        ("https://host.example/v1/", "https://host.example"),
        ("http://host/proxy/v1", "http://host/proxy"),
    ],
)
def test_the_root_drops_a_trailing_slash_and_v1(client: str, url: str, root: str) -> None:
    backend = CLIENTS[client](url)
    try:
        assert backend.base_url == root == server_root(url)
    finally:
        backend.close()


def test_a_base_url_that_is_not_a_string_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="base_url must be a str"):
        server_root(8000)  # type: ignore[arg-type]

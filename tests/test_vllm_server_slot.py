"""VllmServerSlot: one server at a time, restarted only when the config changes.

The server is replaced by a fake (starting a real one takes a minute; the slow tests of
``bench rag`` use the real slot)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkcache.core import vllm_server as module
from chunkcache.core.vllm_server import VllmServer, VllmServerConfig, VllmServerSlot


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the slot did to the fake servers, in order."""
    happened: list[str] = []

    @contextlib.contextmanager
    def fake_server(config: VllmServerConfig) -> Iterator[VllmServer]:
        name = "on" if config.prefix_caching else "off"
        assert config.dev_mode, "the slot needs /reset_prefix_cache"
        happened.append(f"start {name}")
        try:
            yield VllmServer(f"http://{name}", "m", subprocess.Popen(["true"]), Path(name))
        finally:
            happened.append(f"stop {name}")

    monkeypatch.setattr(module, "vllm_server", fake_server)
    monkeypatch.setattr(module, "reset_prefix_cache", lambda url: happened.append(f"reset {url}"))
    return happened


def test_slot_keeps_the_server_for_the_same_config_and_empties_its_prefix_cache(
    events: list[str],
) -> None:
    off, on = VllmServerConfig(prefix_caching=False), VllmServerConfig(prefix_caching=True)
    with VllmServerSlot() as slot:
        assert slot.server(off).base_url == "http://off"
        slot.server(off)  # no prefix cache to empty
        slot.server(on)
        slot.server(on)
    assert events == [
        "start off",
        "stop off",
        "start on",
        "reset http://on",
        "stop on",
    ]


def test_closed_slot_starts_afresh(events: list[str]) -> None:
    slot = VllmServerSlot()
    slot.server(VllmServerConfig())
    slot.close()
    slot.close()  # closing twice is harmless
    slot.server(VllmServerConfig())
    slot.close()
    assert events == ["start on", "stop on", "start on", "stop on"]

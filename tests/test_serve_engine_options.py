"""`chunkcache serve` settings that reach the engine and uvicorn (tiny random Llama)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tiny_models import save_tiny_checkpoint

from chunkcache.core.serve.server import build_backend, uvicorn_config
from chunkcache.core.serve.settings import ServeSettings


@pytest.mark.parametrize("backend", ["local", "batching"])
def test_conversation_memory_settings_reach_the_engine(tmp_path: Path, backend: Any) -> None:
    model = save_tiny_checkpoint(tmp_path / "tiny")
    settings = ServeSettings(
        model=str(model),
        dtype="float32",
        backend=backend,
        max_conversations=3,
        max_conversation_tokens=100,
    )
    built = build_backend(settings, store=None)
    try:
        assert built.engine.max_conversations == 3
        assert built.engine.max_conversation_tokens == 100
    finally:
        if hasattr(built, "shutdown"):
            built.shutdown(timeout_s=5)


def test_unset_conversation_memory_settings_keep_the_engines_defaults() -> None:
    assert ServeSettings().engine_options() == {}


def test_conversation_memory_settings_are_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CHUNKCACHE_SERVE_MAX_CONVERSATION_TOKENS", "4096")
    assert ServeSettings().engine_options() == {"max_conversation_tokens": 4096}
    monkeypatch.setenv("CHUNKCACHE_SERVE_MAX_CONVERSATIONS", "-1")
    with pytest.raises(ValueError, match="max_conversations"):
        ServeSettings()


@pytest.mark.parametrize(("timeout_s", "seconds"), [(0.0, 0), (0.5, 1), (30.0, 30)])
def test_a_shutdown_timeout_under_a_second_is_not_waiting_forever(
    timeout_s: float, seconds: int
) -> None:
    """uvicorn takes whole seconds, and None waits forever: 0.5 used to become None."""
    config = uvicorn_config(object(), ServeSettings(shutdown_timeout_s=timeout_s))
    assert config.timeout_graceful_shutdown == seconds

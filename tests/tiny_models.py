"""Seeded tiny random Llama-family models for the exactness tests (float32, CPU, no hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from chunkcache.core.engine import TokenSegment
from chunkcache.core.kv_store import segment_key
from chunkcache.core.models import LoadedModel

VOCAB = 128
_SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
KINDS = ("llama", "qwen2", "mistral", "llama3_rope")


def tiny_config(kind: str, **overrides: Any) -> PretrainedConfig:
    """A tiny config: Llama, Qwen2 (q/k/v bias), Mistral, or Llama with llama3 RoPE scaling."""
    shape = {**_SHAPE, **overrides}
    if kind == "llama":
        return LlamaConfig(
            **{"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}, **shape}
        )
    if kind == "qwen2":
        return Qwen2Config(**shape)
    if kind == "mistral":
        return MistralConfig(**{"sliding_window": None, **shape})
    if kind == "llama3_rope":
        return LlamaConfig(**shape, rope_parameters=dict(LLAMA3_ROPE))
    raise ValueError(kind)


def tiny_hf_model(kind: str = "llama", seed: int = 0, **overrides: Any) -> Any:
    """A random model whose activations are O(1); every parameter, biases included, is random."""
    config = tiny_config(kind, **overrides)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * (0.1 if "norm" in name else 0.2)
            p.copy_(1.0 + noise if "norm" in name else noise)
    return model.eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``w0 .. w124`` plus ``<unk>``, ``<s>``, ``</s>``."""
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def tiny_lm(kind: str = "llama", seed: int = 0) -> LoadedModel:
    """A tiny random model wrapped for the engine."""
    return LoadedModel.from_hf(tiny_hf_model(kind, seed), tiny_tokenizer())


def save_tiny_checkpoint(directory: Path, kind: str = "llama", seed: int = 0) -> Path:
    """Write a tiny random model and its tokenizer as a safetensors checkpoint directory."""
    tiny_hf_model(kind, seed).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def token_ids(n: int, seed: int = 1) -> torch.Tensor:
    """``n`` random token ids."""
    # -> [n] long
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


# Prompts as token segments, for the engine tests.
TOLERANCE = 1e-4  # max-abs logit difference that counts as exact in float32


def text(ids: list[int] | tuple[int, ...]) -> TokenSegment:
    """A plain-text segment of ``ids``."""
    return TokenSegment(segment_key(ids), tuple(ids), is_chunk=False)


def chunk(name: str, ids: list[int] | tuple[int, ...]) -> TokenSegment:
    """A chunk segment called ``name``."""
    return TokenSegment(name, tuple(ids), is_chunk=True)


def random_ids(n: int, seed: int) -> list[int]:
    """``n`` seeded token ids of the tiny vocabulary."""
    return torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

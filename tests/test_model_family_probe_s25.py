"""Odd Llama-family config shapes against Hugging Face (float32, tiny random models).

Each case is a config a local checkpoint may carry: one KV head or as many as query heads,
an explicit head_dim, untied embeddings, biases, RoPE scalings, and sliding-window settings
that transformers reads per model type. The engine either reproduces the model's logits or
refuses; it never runs attention the model would not.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_models import TOLERANCE, chunk, random_ids, text, tiny_hf_model, tiny_tokenizer

from chunkcache.core.engine import ChunkEngine, PromptTooLongError
from chunkcache.core.model_files import ModelLoadError
from chunkcache.core.model_forward import prefill
from chunkcache.core.models import LoadedModel

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "attention_factor": 0.8,
}
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
ODD_SHAPES: list[tuple[str, dict[str, Any]]] = [
    ("llama", {"num_key_value_heads": 1, "head_dim": 24, "attention_bias": True}),
    ("llama", {"num_key_value_heads": 4, "head_dim": 32, "mlp_bias": True}),
    ("llama", {"tie_word_embeddings": True, "rms_norm_eps": 1e-2}),
    ("llama", {"rope_parameters": YARN}),
    ("llama", {"rope_parameters": LINEAR}),
    ("llama3_rope", {"num_key_value_heads": 1}),
    ("qwen2", {"num_key_value_heads": 1, "head_dim": 24, "tie_word_embeddings": False}),
    ("mistral", {"head_dim": 8, "num_key_value_heads": 4}),
]


def _lm(kind: str, **overrides: Any) -> LoadedModel:
    return LoadedModel.from_hf(tiny_hf_model(kind, **overrides), tiny_tokenizer())


def _hf_last(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return lm.hf(torch.tensor([ids])).logits[0, -1].float()


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize(("kind", "overrides"), ODD_SHAPES)
def test_odd_shapes_match_hf_in_every_exact_policy(kind: str, overrides: dict[str, Any]) -> None:
    lm = _lm(kind, **overrides)
    system, question = text(random_ids(5, 1)), text(random_ids(4, 9))
    a, b = chunk("a", random_ids(9, 2)), chunk("b", random_ids(9, 3))
    request = [system, b, a, question]
    expected = _hf_last(lm, [t for s in request for t in s.ids])
    assert _diff(ChunkEngine(lm).prefill(request, "full").logits, expected) < TOLERANCE
    engine = ChunkEngine(lm)
    engine.prefill([a, question], "full")
    engine.prefill([b, question], "full")
    blended = engine.prefill(request, "cacheblend", ratio=1.0)
    assert blended.stats.recomputed_tokens == 18  # both chunks moved
    assert _diff(blended.logits, expected) < TOLERANCE
    engine = ChunkEngine(lm)
    engine.prefill([system, b, question], "full")
    after_prefix = engine.prefill(request, "prefix")
    assert after_prefix.stats.reused_tokens == 14  # system and b, as cached
    assert _diff(after_prefix.logits, expected) < TOLERANCE


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_one_token_prompt_matches_hf(kind: str) -> None:
    lm = _lm(kind, num_key_value_heads=1, head_dim=24)
    logits, _ = prefill(lm, torch.tensor([7]))
    assert _diff(logits, _hf_last(lm, [7])) < TOLERANCE


def test_bfloat16_stays_as_close_to_float32_as_hf_in_bfloat16() -> None:
    """bf16 rounds differently on every path; the engine may not drift further than HF's own."""
    ids = random_ids(40, 4)
    lm32 = _lm("llama", num_key_value_heads=1, head_dim=24)
    lm16 = LoadedModel.from_hf(
        tiny_hf_model("llama", num_key_value_heads=1, head_dim=24).to(torch.bfloat16),
        tiny_tokenizer(),
    )
    reference = _hf_last(lm32, ids)
    hf_error = _diff(_hf_last(lm16, ids), reference)
    logits, _ = prefill(lm16, torch.tensor(ids))
    assert _diff(logits, reference) <= max(2 * hf_error, 0.05)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_rope_whose_frequencies_follow_the_length_is_refused(rope_type: str) -> None:
    params = {
        "rope_type": rope_type,
        "rope_theta": 10000.0,
        "factor": 4.0,
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 128,
    }
    with pytest.raises(ModelLoadError, match=rope_type):
        _lm("llama", rope_parameters=params)


def test_llama_ignores_a_sliding_window_in_its_config() -> None:
    """transformers' Llama attends to the whole sequence whatever ``sliding_window`` says
    (a key transformers keeps as a config attribute), so the engine must not cap the
    context window or refuse longer prompts there."""
    lm = _lm("llama", sliding_window=8)
    assert lm.spec.sliding_window is None
    assert lm.spec.context_window == 512
    ids = random_ids(20, 5)
    out = ChunkEngine(lm).prefill([text(ids)], "full")
    assert _diff(out.logits, _hf_last(lm, ids)) < TOLERANCE


def test_mistral_slides_whatever_its_layer_types_say() -> None:
    """transformers' Mistral applies ``sliding_window`` to every layer and reads no
    ``layer_types``: a config carrying one that lists only full attention still slides,
    so a prompt past the window is refused rather than answered with full attention."""
    lm = _lm("mistral", sliding_window=8, layer_types=["full_attention"] * 3)
    assert lm.spec.sliding_window == 8
    with pytest.raises(PromptTooLongError):
        ChunkEngine(lm).prefill([text(random_ids(20, 5))], "full")

"""CacheBlend's gradual filter: the fast check layers choose and compute what whole layers do."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import tiny_hf_model, tiny_lm, tiny_tokenizer

from chunkcache.core.model_forward import embed, prefill, run_layers
from chunkcache.core.models import LoadedModel
from chunkcache.core.recompute import (
    FIRST_CHECK_LAYER,
    GRADUAL_FILTER,
    blend_share,
    kv_write_share,
    recompute,
)
from chunkcache.kernels.kv import SeqKV
from chunkcache.kernels.layer import Rows, layer_step


def reference_blend(
    lm: LoadedModel, kv: SeqKV, ids: torch.Tensor, computed: torch.Tensor, ratio: float
) -> tuple[torch.Tensor, int]:
    """CacheBlend as first written: every candidate row runs the whole check layer."""
    # kv: merged KV whose slots not in ``computed`` are reused; ids: [S]
    reused = torch.tensor([s for s in range(kv.length) if s not in set(computed.tolist())])
    slots = torch.cat((computed, reused)).sort().values  # [M]
    x = embed(lm, ids[slots])  # x: [M, E]
    for layer in range(FIRST_CHECK_LAYER):  # every row, nothing dropped
        x = run_layers(lm, x, Rows.build(slots, kv.length, lm.rope), kv, range(layer, layer + 1))
    for layer, share in enumerate(GRADUAL_FILTER, start=FIRST_CHECK_LAYER):
        k, v = kv.layer(layer)
        is_reused = torch.isin(slots, reused)  # [M]
        cached_v = v[:, slots[is_reused]].clone()  # [H_kv, R', D]
        x = layer_step(lm.decoder.layers[layer], x, Rows.build(slots, kv.length, lm.rope), k, v)
        deviation = (v[:, slots[is_reused]] - cached_v).norm(dim=(0, 2))  # [R']
        keep = math.ceil(min(1.0, share * ratio) * reused.numel())
        chosen = slots[is_reused][deviation.topk(keep).indices]
        stay = ~is_reused | torch.isin(slots, chosen)
        slots, x = slots[stay], x[stay]
    rows = Rows.build(slots, kv.length, lm.rope)
    first_plain = FIRST_CHECK_LAYER + len(GRADUAL_FILTER)
    x = run_layers(lm, x, rows, kv, range(first_plain, lm.spec.num_layers))
    return x[-1], int(torch.isin(slots, reused).sum())


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("ratio", [0.15, 0.5])
def test_gradual_filter_matches_whole_check_layers(kind: str, ratio: float) -> None:
    # One layer past the check layers, so the last check is not the last layer.
    layers = FIRST_CHECK_LAYER + len(GRADUAL_FILTER) + 1
    lm = LoadedModel.from_hf(tiny_hf_model(kind, num_hidden_layers=layers), tiny_tokenizer())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 120, (40,), generator=gen)
    _, kv = prefill(lm, torch.randint(3, 120, (40,), generator=gen))  # unrelated: "reused" KV
    computed = torch.cat((torch.arange(0, 6), torch.arange(34, 40)))  # [C]
    reused = torch.arange(6, 34)  # [R]
    mine_kv = SeqKV(kv.k.clone(), kv.v.clone(), kv.length)
    result = recompute(lm, mine_kv, ids, computed, reused, ratio)
    expected, num_recomputed = reference_blend(lm, kv, ids, computed, ratio)
    assert result.num_recomputed == num_recomputed
    torch.testing.assert_close(result.last_hidden, expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(mine_kv.keys(), kv.keys(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("ratio", [0.0, 0.15, 0.5, 1.0])
def test_blend_share_is_what_recompute_spends(ratio: float) -> None:
    layers = FIRST_CHECK_LAYER + len(GRADUAL_FILTER) + 3
    lm = LoadedModel.from_hf(tiny_hf_model("llama", num_hidden_layers=layers), tiny_tokenizer())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 120, (220,), generator=gen)
    _, kv = prefill(lm, torch.randint(3, 120, (220,), generator=gen))
    computed, reused = torch.tensor([219]), torch.arange(219)
    result = recompute(lm, kv, ids, computed, reused, ratio)
    spent = (result.token_layers - layers) / (219 * layers)  # the reused rows' share
    # each gradual step keeps ceil(share * R) rows: at most one row per layer more
    assert blend_share(ratio, layers) <= spent <= blend_share(ratio, layers) + 1 / 219
    assert blend_share(0.15, 30) == pytest.approx((2 + 1.5 * 0.15 + 27 * 0.15) / 30)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_kv_write_share_is_the_kv_projections_share_of_a_layers_matmuls(kind: str) -> None:
    config = tiny_hf_model(kind).config
    e, d = config.hidden_size, config.hidden_size // config.num_attention_heads
    q_o = 2 * e * config.num_attention_heads * d
    kv = 2 * e * config.num_key_value_heads * d
    mlp = 3 * e * config.intermediate_size
    assert kv_write_share(tiny_lm(kind)) == pytest.approx(kv / (q_o + kv + mlp))


def test_blend_share_counts_a_check_layers_dropped_rows_at_their_kv_cost() -> None:
    k = 0.0625  # SmolLM2's kv_write_share
    # layer 0 whole; layer 1 writes every row's K/V and finishes 1.5r; layer 2 writes 1.5r
    # and finishes r; the 27 layers after run r
    check_1, check_2 = k + (1 - k) * 0.225, k * 0.225 + (1 - k) * 0.15
    expected = (1 + check_1 + check_2 + 27 * 0.15) / 30
    assert blend_share(0.15, 30, k) == pytest.approx(expected)
    assert blend_share(0.15, 30, k) < blend_share(0.15, 30)  # compute below token-layers
    assert blend_share(0.15, 30, 0.0) == pytest.approx((1 + 0.225 + 0.15 + 27 * 0.15) / 30)


def test_values_depend_on_the_context_from_the_first_check_layer_on() -> None:
    """Why deviation is read from layer 1: the same tokens after two different contexts
    have equal layer-0 values, and different values from layer 1 on."""
    lm = tiny_lm("llama")
    gen = torch.Generator().manual_seed(3)
    chunk = torch.randint(3, 120, (12,), generator=gen)
    views = []
    for _ in range(2):
        context = torch.randint(3, 120, (8,), generator=gen)
        _, kv = prefill(lm, torch.cat((context, chunk)))
        views.append(kv.v[:, :, 8:20])  # [L, H_kv, 12, D]
    first, second = views
    torch.testing.assert_close(first[:FIRST_CHECK_LAYER], second[:FIRST_CHECK_LAYER])
    assert (first[FIRST_CHECK_LAYER] - second[FIRST_CHECK_LAYER]).abs().max() > 1e-3

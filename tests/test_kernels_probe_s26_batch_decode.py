"""Randomized property tests of the batched decode layer step: B sequences of ragged lengths,
each row equal to the same layer run for that sequence alone (:func:`layer_step` on its last
slot), for GQA with 1, 2 and 3 KV heads and an explicit head dimension.

Tolerances: float32 within 1e-5 of the sequence run alone; bfloat16 within two bf16 ulps of
the largest output (2^-6 of it) of the same bf16 weights run in float32.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_models import tiny_hf_model

from chunkcache.core.models import rope_from_config
from chunkcache.kernels.batch_decode import batch_layer_step
from chunkcache.kernels.kv import SeqKV
from chunkcache.kernels.layer import Rows, layer_step

SHAPES: dict[str, dict[str, Any]] = {
    "mha_1kv": {"num_attention_heads": 4, "num_key_value_heads": 1},
    "gqa_2kv": {"num_attention_heads": 4, "num_key_value_heads": 2},
    "gqa_3kv": {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48},
    "head_dim_8": {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8},
    "head_dim_64": {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64},
}


def _layer(shape: str, kind: str = "llama") -> tuple[Any, Any]:
    model = tiny_hf_model(kind, **SHAPES[shape])
    return model.model.layers[0], model.config


def _kvs(lengths: list[int], h_kv: int, d: int, gen: torch.Generator) -> list[SeqKV]:
    """Sequences whose past slots hold random KV, each one slot longer for the new token."""
    kvs = []
    for n in lengths:
        kv = SeqKV.empty(1, h_kv, d, capacity=n, dtype=torch.float32, device=torch.device("cpu"))
        kv.extend(n - 1)
        kv.k[:, :, : n - 1] = torch.randn(1, h_kv, n - 1, d, generator=gen)
        kv.v[:, :, : n - 1] = torch.randn(1, h_kv, n - 1, d, generator=gen)
        kv.extend(1)  # the new token's slot, unset: the step writes it
        kvs.append(kv)
    return kvs


def _copy(kv: SeqKV, dtype: torch.dtype = torch.float32) -> SeqKV:
    return SeqKV(kv.k.to(dtype, copy=True), kv.v.to(dtype, copy=True), kv.length)


def _alone(layer: Any, rope: Any, x: torch.Tensor, kv: SeqKV) -> torch.Tensor:
    """The layer for the sequence's last slot only, as a prefill of one token runs it."""
    last = kv.length - 1
    return layer_step(
        layer, x[None], Rows.build(torch.tensor([last]), kv.length, rope), *kv.layer(0)
    )


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_batched_rows_equal_each_sequence_alone(shape: str, kind: str) -> None:
    layer, config = _layer(shape, kind)
    h_kv, d = layer.self_attn.config.num_key_value_heads, layer.self_attn.head_dim
    rope, gen = rope_from_config(config, d), torch.Generator().manual_seed(1)
    for batch in (1, 2, 5):
        lengths = [1, 2, *torch.randint(1, 90, (batch,), generator=gen).tolist()][-batch:]
        kvs = _kvs(lengths, h_kv, d, gen)
        alone = [_copy(kv) for kv in kvs]
        x = torch.randn(batch, config.hidden_size, generator=gen)  # [B, E]
        positions = torch.tensor([kv.length - 1 for kv in kvs])
        cos, sin = rope.cos_sin(positions)
        with torch.no_grad():
            out = batch_layer_step(layer, x, cos, sin, [kv.layer(0) for kv in kvs])
            for row, kv in enumerate(alone):
                expected = _alone(layer, rope, x[row], kv)[0]
                torch.testing.assert_close(out[row], expected, atol=1e-5, rtol=1e-5)
        for got, want in zip(kvs, alone, strict=True):  # the new slot written, nothing else
            torch.testing.assert_close(got.keys(), want.keys(), atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(got.values(), want.values(), atol=1e-6, rtol=1e-6)


def test_bfloat16_batch_is_within_bf16_rounding_of_float32() -> None:
    # the batch (float32 attention per row) and each row alone (SDPA) both within two bf16
    # ulps of the largest output of the same bf16 weights computed in float32
    for seed in range(3):
        layer, config = _layer("gqa_3kv")
        layer = layer.bfloat16()
        h_kv, d = layer.self_attn.config.num_key_value_heads, layer.self_attn.head_dim
        rope, gen = rope_from_config(config, d), torch.Generator().manual_seed(seed)
        lengths = [1, 7, 300, 64]
        kvs = _kvs(lengths, h_kv, d, gen)
        wide, narrow = [_copy(kv) for kv in kvs], [_copy(kv, torch.bfloat16) for kv in kvs]
        alone_kvs = [_copy(kv, torch.bfloat16) for kv in kvs]
        x = torch.randn(len(lengths), config.hidden_size, generator=gen).bfloat16()  # [B, E]
        cos, sin = rope.cos_sin(torch.tensor([n - 1 for n in lengths]))
        with torch.no_grad():
            out = batch_layer_step(layer, x, cos, sin, [kv.layer(0) for kv in narrow])
            alone = torch.cat([_alone(layer, rope, x[b], kv) for b, kv in enumerate(alone_kvs)])
            layer.float()
            expected = batch_layer_step(layer, x.float(), cos, sin, [kv.layer(0) for kv in wide])
        assert out.dtype == torch.bfloat16
        tol = 2**-6 * float(expected.abs().max())  # [B, E] outputs reach ~10
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=0)
        torch.testing.assert_close(alone.float(), expected, atol=tol, rtol=0)


def test_a_row_count_unlike_the_sequences_is_refused() -> None:
    layer, config = _layer("gqa_2kv")
    kvs = _kvs([3], 2, layer.self_attn.head_dim, torch.Generator().manual_seed(3))
    cos, sin = rope_from_config(config, layer.self_attn.head_dim).cos_sin(torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="2 rows but 1 sequences"):
        batch_layer_step(layer, torch.zeros(2, config.hidden_size), cos, sin, [kvs[0].layer(0)])

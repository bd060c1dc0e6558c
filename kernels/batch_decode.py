"""One decoder-layer step for B sequences decoding one token each (continuous batching).

Each sequence has its own merged KV of its own length. The row-wise work (norms, Q/K/V/O
projections, MLP) runs on the ``[B, E]`` batch at once, so a decode step reads every weight
once for all B sequences instead of once per sequence; that is what makes batching pay on a
memory-bound CPU decode. Each row is rotated at its own position, its K/V is written into its
own sequence, and it attends over its own sequence, one small attention per row.

Looping over the rows beat padding them into one batch on this CPU (2026-11-23, 2-core AMD EPYC
without AMX, SmolLM2 bf16, one thread, load ~7; sequences of 300-1,200 tokens): 154 / 224 / 334
ms per step for B = 1 / 4 / 8 against 163 / 266 / 471 ms padded. The padded batch copies every
sequence's K/V into a ``[B, H_kv, S_max, D]`` buffer each layer and step and computes the
padding too."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from chunkcache.kernels.rope import apply_rope


def batch_layer_step(
    layer: Any, x: Tensor, cos: Tensor, sin: Tensor, kvs: Sequence[tuple[Tensor, Tensor]]
) -> Tensor:
    """Run a Hugging Face Llama/Mistral/Qwen2 decoder ``layer`` for one new token per sequence.

    Row ``b`` of ``x`` is the newest token of sequence ``b``; ``kvs[b]`` are views of that
    sequence's layer keys and values whose last slot is the new token's (written here, in
    place). ``cos``/``sin`` hold each row's RoPE at its own position. Returns the rows' output
    hidden states (attention and MLP, each with its residual).
    """
    # x: [B, E]; cos, sin: [B, D]; kvs[b]: ([H_kv, S_b, D], [H_kv, S_b, D])
    if len(kvs) != x.shape[0]:
        raise ValueError(f"{x.shape[0]} rows but {len(kvs)} sequences")
    attn = layer.self_attn
    rows, head_dim = x.shape[0], attn.head_dim
    h = layer.input_layernorm(x)  # h: [B, E]
    q = attn.q_proj(h).view(rows, -1, head_dim).transpose(0, 1)  # q: [H, B, D]
    k_new = attn.k_proj(h).view(rows, -1, head_dim).transpose(0, 1)  # k_new: [H_kv, B, D]
    v_new = attn.v_proj(h).view(rows, -1, head_dim).transpose(0, 1)  # v_new: [H_kv, B, D]
    q, k_new = apply_rope(q, cos, sin), apply_rope(k_new, cos, sin)
    out = x.new_empty(rows, q.shape[0] * head_dim)  # out: [B, H * D]
    for row, (k, v) in enumerate(kvs):
        k[:, -1], v[:, -1] = k_new[:, row], v_new[:, row]
        out[row] = _attend_last(q[:, row : row + 1], k, v, attn.scaling)
    x = x + attn.o_proj(out)  # x: [B, E]
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _attend_last(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Attention of a sequence's newest token over all its keys (no mask: it sees them all).

    Two float32 matmuls: for one bf16 query row, SDPA's CPU flash kernel took 5-10x longer
    (0.8-1.7 ms vs 0.15-0.2 ms at 300-1,200 keys, SmolLM2 heads) with no better accuracy.
    """
    # q: [H, 1, D]; k, v: [H_kv, S, D] -> [H * D]
    h_kv, head_dim = k.shape[0], k.shape[2]
    q = q.reshape(h_kv, -1, head_dim).float()  # q: [H_kv, G, D]; head h reads KV head h // G
    scores = torch.bmm(q, k.float().transpose(1, 2)) * scale  # scores: [H_kv, G, S]
    return torch.bmm(scores.softmax(-1), v.float()).flatten()  # [H_kv, G, D] -> [H * D]

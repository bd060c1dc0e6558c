"""The engine's own layer loop over a :class:`LoadedModel`, built from the kernels.

A full prefill is :func:`run_layers` with every token chosen; prefix reuse and decoding are
:func:`prefill` on top of a past :class:`SeqKV`; selective recompute (CacheBlend §4.2) is
:func:`run_layers` for a few chosen rows over reused KV, layer range by layer range.
"""

from __future__ import annotations

import torch
from torch import Tensor

from chunkcache.core.models import LoadedModel
from chunkcache.kernels.kv import SeqKV
from chunkcache.kernels.layer import Rows, layer_step


@torch.no_grad()
def embed(lm: LoadedModel, ids: Tensor) -> Tensor:
    """Input hidden states of tokens ``ids``."""
    # ids: [N] long -> [N, E]
    return lm.decoder.embed_tokens(ids)


@torch.no_grad()
def last_logits(lm: LoadedModel, x: Tensor) -> Tensor:
    """Float32 next-token logits from one row's last-layer hidden state."""
    # x: [E] -> [V]
    return lm.lm_head(lm.decoder.norm(x)).float()


@torch.no_grad()
def run_layers(
    lm: LoadedModel, x: Tensor, rows: Rows, kv: SeqKV, layers: range | None = None
) -> Tensor:
    """Run ``layers`` (default: all) for the chosen rows over ``kv``; K/V of the rows are
    written into ``kv`` in place, every other slot is reused. Returns the rows' hidden states."""
    # x: [N, E] hidden states of the rows entering the first layer of ``layers``
    window = lm.spec.sliding_window
    if window is not None and kv.length > window:
        raise ValueError(f"{kv.length} tokens exceed the model's sliding window of {window}")
    for i in layers if layers is not None else range(lm.spec.num_layers):
        x = layer_step(lm.decoder.layers[i], x, rows, *kv.layer(i))
    return x  # [N, E]


@torch.no_grad()
def prefill(lm: LoadedModel, ids: Tensor, kv: SeqKV | None = None) -> tuple[Tensor, SeqKV]:
    """Prefill tokens ``ids`` after the ``kv.length`` tokens already in ``kv`` (none if None).

    Extends ``kv`` in place (a new one when None) with the tokens' rotated keys and values at
    positions ``kv.length ...`` and returns the float32 logits of the last token and the KV.
    """
    # ids: [N] long
    ids = ids.to(lm.device)
    kv = kv if kv is not None else lm.new_kv(ids.numel())
    start = kv.length
    kv.extend(ids.numel())
    rows = Rows.build(torch.arange(start, kv.length, device=lm.device), kv.length, lm.rope)
    x = run_layers(lm, embed(lm, ids), rows, kv)  # x: [N, E]
    return last_logits(lm, x[-1]), kv  # [V], kv with S = start + N

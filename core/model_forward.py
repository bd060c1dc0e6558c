"""The engine's own layer loop over a :class:`LoadedModel`, built from the kernels.

A full prefill is :func:`run_layers` with every token chosen; prefix reuse and decoding are
:func:`prefill` on top of a past :class:`SeqKV`; selective recompute (CacheBlend §4.2) is
:func:`run_layers` for a few chosen rows over reused KV, layer range by layer range.
A prefill reads only its last row's output, so it ends with :func:`run_layers_to_last`,
whose final layer writes every row's K/V but finishes the last row alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

from chunkcache.core.models import LoadedModel
from chunkcache.kernels.kv import SeqKV
from chunkcache.kernels.layer import Rows, finish_rows, layer_step, write_kv


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
def run_layers_to_last(lm: LoadedModel, x: Tensor, rows: Rows, kv: SeqKV, first: int = 0) -> Tensor:
    """:func:`run_layers` from layer ``first`` to the model's last, returning the last row's
    final hidden state only.

    On the last layer every row writes its K/V (a later token reads them) but only the last
    row runs attention and the MLP: the other rows' outputs would never be read, and those
    are ~15/16 of a row's work there (SmolLM2: 1/30 of a full prefill).
    """
    # x: [N, E] hidden states of the rows entering layer ``first``
    final = lm.spec.num_layers - 1
    if not 0 <= first <= final:
        raise ValueError(f"first must be a layer in [0, {final}], got {first}")
    x = run_layers(lm, x, rows, kv, range(first, final))  # x: [N, E]
    layer, (k, v) = lm.decoder.layers[final], kv.layer(final)
    h = layer.input_layernorm(x)  # h: [N, E]
    write_kv(layer, h, rows, k, v)
    last = rows.subset(torch.tensor([x.shape[0] - 1], device=x.device))
    return finish_rows(layer, x[-1:], h[-1:], last, k, v)[0][0]  # [E]


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
    last = run_layers_to_last(lm, embed(lm, ids), rows, kv)  # last: [E]
    return last_logits(lm, last), kv  # [V], kv with S = start + N

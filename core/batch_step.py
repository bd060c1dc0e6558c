"""One batched decode step over a :class:`LoadedModel`: B sequences, one new token each."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from chunkcache.core.model_forward import embed, last_logits
from chunkcache.core.models import LoadedModel
from chunkcache.kernels.batch_decode import batch_layer_step
from chunkcache.kernels.kv import SeqKV


@torch.no_grad()
def decode_step(lm: LoadedModel, tokens: Sequence[int], kvs: Sequence[SeqKV]) -> Tensor:
    """Append ``tokens[b]`` to sequence ``kvs[b]`` (in place, at slot ``kvs[b].length``) and
    return every sequence's float32 next-token logits, ``[B, V]``.

    The same result, row by row, as :func:`chunkcache.core.model_forward.prefill` of one token
    on each sequence alone, with each weight read once for the whole batch. A step that
    raises leaves every sequence's length as it was, so its tokens can be stepped again.
    """
    if not tokens or len(tokens) != len(kvs):
        raise ValueError(f"need one token per sequence, got {len(tokens)} for {len(kvs)}")
    if len({id(kv) for kv in kvs}) != len(kvs):
        raise ValueError("a sequence appears twice in one decode step")
    window = lm.spec.sliding_window
    if window is not None and any(kv.length + 1 > window for kv in kvs):
        raise ValueError(f"a sequence would exceed the model's sliding window of {window}")
    lengths = [kv.length for kv in kvs]
    try:
        return _step(lm, tokens, kvs)
    except BaseException:
        for kv, length in zip(kvs, lengths, strict=True):
            kv.length = length  # the failed step's slot is spare capacity again
        raise


def _step(lm: LoadedModel, tokens: Sequence[int], kvs: Sequence[SeqKV]) -> Tensor:
    positions = torch.tensor([kv.length for kv in kvs], device=lm.device)  # [B]
    for kv in kvs:
        kv.extend(1)
    cos, sin = lm.rope.cos_sin(positions)  # cos, sin: [B, D]
    x = embed(lm, torch.tensor(list(tokens), device=lm.device))  # x: [B, E]
    for i, layer in enumerate(lm.decoder.layers):
        x = batch_layer_step(layer, x, cos, sin, [kv.layer(i) for kv in kvs])
    return last_logits(lm, x)  # [B, V]

"""The batched decode step equals decoding each sequence alone (tiny random models, float32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_models import KINDS, TOLERANCE, tiny_lm, token_ids

from chunkcache.core import batch_step
from chunkcache.core.batch_step import decode_step
from chunkcache.core.model_forward import prefill
from chunkcache.core.models import LoadedModel
from chunkcache.kernels.kv import SeqKV

LENGTHS = (5, 17, 40)


@pytest.fixture(scope="module", params=KINDS)
def lm(request: pytest.FixtureRequest) -> LoadedModel:
    return tiny_lm(request.param)


def _copy(kv: SeqKV) -> SeqKV:
    return SeqKV(kv.k.clone(), kv.v.clone(), kv.length)


def _prompts(lm: LoadedModel) -> list[SeqKV]:
    return [prefill(lm, token_ids(n, seed=n))[1] for n in LENGTHS]


def test_batched_steps_equal_each_sequence_alone(lm: LoadedModel) -> None:
    batched = _prompts(lm)
    alone = [_copy(kv) for kv in batched]
    for step in range(3):  # the sequences grow by one token per step, each at its own position
        tokens = [int(t) for t in token_ids(len(LENGTHS), seed=100 + step)]
        logits = decode_step(lm, tokens, batched)  # logits: [B, V]
        assert logits.shape == (len(LENGTHS), lm.spec.vocab_size)
        for row, (token, kv) in enumerate(zip(tokens, alone, strict=True)):
            expected, _ = prefill(lm, torch.tensor([token]), kv)
            assert (logits[row] - expected).abs().max() < TOLERANCE
    for got, want in zip(batched, alone, strict=True):
        assert got.length == want.length
        assert (got.keys() - want.keys()).abs().max() < TOLERANCE
        assert (got.values() - want.values()).abs().max() < TOLERANCE


def test_a_batch_of_one_equals_prefill(lm: LoadedModel) -> None:
    (kv,) = [prefill(lm, token_ids(9))[1]]
    expected, _ = prefill(lm, torch.tensor([7]), _copy(kv))
    logits = decode_step(lm, [7], [kv])
    assert (logits[0] - expected).abs().max() < TOLERANCE


def test_the_buffer_grows_when_a_sequence_is_full(lm: LoadedModel) -> None:
    kv = prefill(lm, token_ids(6))[1]
    assert kv.length == kv.capacity  # no spare slot: the step must grow the buffer
    reference = _copy(kv)
    logits = decode_step(lm, [3], [kv])
    expected, _ = prefill(lm, torch.tensor([3]), reference)
    assert (logits[0] - expected).abs().max() < TOLERANCE


def test_bad_batches_are_refused(lm: LoadedModel) -> None:
    kv = prefill(lm, token_ids(4))[1]
    with pytest.raises(ValueError, match="one token per sequence"):
        decode_step(lm, [1, 2], [kv])
    with pytest.raises(ValueError, match="twice"):
        decode_step(lm, [1, 2], [kv, kv])


def test_a_failed_step_leaves_every_sequence_as_it_was(
    lm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that raises mid-way (here in its second layer) can be taken again: the
    sequences keep their lengths, and the retry computes what a first try would have."""
    kvs = _prompts(lm)
    kvs.append(prefill(lm, token_ids(6))[1])  # full: the failed step grew its buffer
    lengths = [kv.length for kv in kvs]
    reference = [_copy(kv) for kv in kvs]
    tokens = [int(t) for t in token_ids(len(kvs), seed=7)]
    layer_step = batch_step.batch_layer_step
    calls: list[int] = []

    def failing(*args: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return layer_step(*args)

    monkeypatch.setattr(batch_step, "batch_layer_step", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        decode_step(lm, tokens, kvs)
    assert [kv.length for kv in kvs] == lengths
    logits = decode_step(lm, tokens, kvs)
    expected = decode_step(lm, tokens, reference)
    assert (logits - expected).abs().max() < TOLERANCE
    for got, want in zip(kvs, reference, strict=True):
        assert got.length == want.length
        assert (got.keys() - want.keys()).abs().max() < TOLERANCE

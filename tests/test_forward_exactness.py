"""The exactness gate: the own layer loop reproduces Hugging Face on tiny random models."""

from __future__ import annotations

import pytest
import torch
from tiny_models import KINDS, tiny_hf_model, tiny_lm, token_ids

from chunkcache.core.model_forward import (
    embed,
    last_logits,
    prefill,
    run_layers,
    run_layers_to_last,
)
from chunkcache.core.models import LoadedModel
from chunkcache.kernels.kv import SeqKV
from chunkcache.kernels.layer import Rows

S = 48


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


@pytest.fixture(scope="module", params=KINDS)
def lm(request: pytest.FixtureRequest) -> LoadedModel:
    return tiny_lm(request.param)


def _garbage_kv(lm: LoadedModel, length: int) -> SeqKV:
    kv = lm.new_kv(length)
    kv.extend(length)
    kv.k.normal_(0, 10), kv.v.normal_(0, 10)
    return kv


def test_prefill_matches_hf_logits_and_kv(lm: LoadedModel) -> None:
    ids = token_ids(S)
    with torch.no_grad():
        out = lm.hf(ids[None], use_cache=True)
    logits, kv = prefill(lm, ids)
    _close(logits, out.logits[0, -1])
    for i, layer in enumerate(out.past_key_values.layers):  # keys: [1, H_kv, S, D], rotated
        _close(kv.keys()[i], layer.keys[0])
        _close(kv.values()[i], layer.values[0])


def test_prefill_on_top_of_past_equals_full_prefill(lm: LoadedModel) -> None:
    ids = token_ids(S)
    full_logits, full_kv = prefill(lm, ids)
    kv = lm.new_kv(4)  # small on purpose: the buffer has to grow
    for a, b in [(0, 20), (20, 21), (21, 40), (40, 47), (47, 48)]:
        logits, kv = prefill(lm, ids[a:b], kv)
    assert kv.length == S
    _close(logits, full_logits)
    _close(kv.keys(), full_kv.keys())
    _close(kv.values(), full_kv.values())


def test_recomputing_every_token_over_garbage_kv_equals_full_prefill(lm: LoadedModel) -> None:
    ids = token_ids(S)
    full_logits, full_kv = prefill(lm, ids)
    kv = _garbage_kv(lm, S)
    x = run_layers(lm, embed(lm, ids), Rows.build(torch.arange(S), S, lm.rope), kv)
    _close(last_logits(lm, x[-1]), full_logits)
    _close(kv.keys(), full_kv.keys())


def test_recomputing_a_garbage_tail_over_an_exact_prefix_equals_full_prefill(
    lm: LoadedModel,
) -> None:
    ids, j = token_ids(S), 30
    full_logits, full_kv = prefill(lm, ids)
    kv = _garbage_kv(lm, S)
    kv.k[:, :, :j], kv.v[:, :, :j] = full_kv.k[:, :, :j], full_kv.v[:, :, :j]
    tail = torch.arange(j, S)
    x = run_layers(lm, embed(lm, ids[tail]), Rows.build(tail, S, lm.rope), kv)
    _close(last_logits(lm, x[-1]), full_logits)
    _close(kv.values(), full_kv.values())


def test_recomputing_scattered_rows_over_exact_kv_is_a_fixed_point(lm: LoadedModel) -> None:
    """With every other token's KV exact, recomputed scattered rows come out exact."""
    ids = token_ids(S)
    _, full_kv = prefill(lm, ids)
    with torch.no_grad():
        final = lm.hf(ids[None], output_hidden_states=True).hidden_states[-1][0]  # [S, E]
    kv = SeqKV(full_kv.k.clone(), full_kv.v.clone(), S)
    chosen = torch.tensor([2, 3, 11, 25, 26, 40, S - 1])
    rows = Rows.build(chosen, S, lm.rope)
    x = run_layers(lm, embed(lm, ids[chosen]), rows, kv)  # x: [7, E] before the final norm
    _close(lm.decoder.norm(x), final[chosen])
    _close(kv.keys(), full_kv.keys())


def test_layer_ranges_compose_and_rows_can_shrink_between_them(lm: LoadedModel) -> None:
    """The engine's pattern: run a few layers, drop rows, run the rest (gradual filtering)."""
    ids = token_ids(S)
    full_logits, full_kv = prefill(lm, ids)
    kv = SeqKV(full_kv.k.clone(), full_kv.v.clone(), S)
    rows = Rows.build(torch.tensor([5, 9, 30, S - 1]), S, lm.rope)
    x = run_layers(lm, embed(lm, ids[rows.index]), rows, kv, range(1))
    keep = torch.tensor([1, 3])  # rows 9 and S - 1 go on
    x = run_layers(lm, x[keep], rows.subset(keep), kv, range(1, lm.spec.num_layers))
    _close(last_logits(lm, x[-1]), full_logits)


def test_finishing_only_the_last_row_on_the_last_layer_keeps_every_rows_kv(
    lm: LoadedModel,
) -> None:
    """A prefill reads the last row's output only; every row's K/V must still be written."""
    ids = token_ids(S)
    full_logits, full_kv = prefill(lm, ids)
    kv = SeqKV(full_kv.k.clone(), full_kv.v.clone(), S)
    rows = Rows.build(torch.tensor([4, 17, 30, S - 1]), S, lm.rope)
    kv.k[:, :, rows.index] = 0.0  # the rows' own K/V: recomputed on every layer, last too
    kv.v[:, :, rows.index] = 0.0
    x = run_layers(lm, embed(lm, ids[rows.index]), rows, kv, range(2))
    last = run_layers_to_last(lm, x, rows, kv, first=2)  # last: [E]
    _close(last_logits(lm, last), full_logits)
    _close(kv.keys(), full_kv.keys())
    _close(kv.values(), full_kv.values())
    with pytest.raises(ValueError, match="first must be a layer"):
        run_layers_to_last(lm, x, rows, kv, first=lm.spec.num_layers)


def test_chunk_keys_moved_to_a_new_position_equal_keys_computed_there(lm: LoadedModel) -> None:
    """Layer-0 keys depend on token and position only, so a moved chunk must match exactly."""
    chunk, b = token_ids(10, seed=2), 23
    _, alone = prefill(lm, chunk)  # chunk at positions [0, 10)
    _, inside = prefill(lm, torch.cat([token_ids(b, seed=3), chunk]))  # at [23, 33)
    moved = lm.rope.shift(alone.keys()[0], b)  # [H_kv, 10, D]
    torch.testing.assert_close(moved, inside.keys()[0, :, b:], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("mistral", {"sliding_window": 16}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
    ],
)
def test_sequences_longer_than_a_sliding_window_are_refused(kind: str, overrides: dict) -> None:
    """Up to the window, sliding-window attention is plain causal attention; past it, refuse."""
    lm = LoadedModel.from_hf(tiny_hf_model(kind, **overrides))
    assert lm.spec.sliding_window == 16
    ids = token_ids(16)
    with torch.no_grad():
        _close(prefill(lm, ids)[0], lm.hf(ids[None]).logits[0, -1])
    with pytest.raises(ValueError, match="sliding window"):
        prefill(lm, token_ids(17))


def test_qwen2_without_sliding_layers_has_no_window() -> None:
    lm = LoadedModel.from_hf(tiny_hf_model("qwen2", sliding_window=16))
    assert lm.spec.sliding_window is None

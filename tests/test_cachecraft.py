"""Cache-Craft (§3.1-3.3): attention probes, reusability scores, variant choice, the policy.

Exactness: with CFO = 1 everywhere (alpha huge, no cap, no early termination) ``cachecraft``
gives the logits of a full prefill; with alpha = 0 it is ``reuse``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_models import TOLERANCE, chunk, random_ids, text, tiny_hf_model, tiny_lm, tiny_tokenizer

from chunkcache.core.craft import (
    CraftConfig,
    CraftMeta,
    adjusted_overlap,
    fit_budget,
    fix_overhead,
    focused_chunks,
    num_fix_tokens,
    order_penalty,
    prefix_overlap,
    top_tokens,
)
from chunkcache.core.craft_probe import MetaProbe, Span
from chunkcache.core.engine import ChunkEngine, TokenSegment
from chunkcache.core.kv_store import MemoryKVStore
from chunkcache.core.models import LoadedModel
from chunkcache.core.recompute import blend_share, kv_write_share
from chunkcache.kernels.layer import Probe, Rows, layer_step, layer_step_probed

NO_FOCUS = CraftConfig(focus_window=None)


SYSTEM, OTHER_SYSTEM = text(random_ids(9, 1)), text(random_ids(8, 21))
A, B, C, D = (chunk(name, random_ids(17, seed)) for seed, name in enumerate("abcd", start=2))
QUESTION = text(random_ids(7, 9))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lm(request: pytest.FixtureRequest) -> LoadedModel:
    return tiny_lm(request.param)


def meta(ids: tuple[str, ...], inter: tuple[float, ...], cci: float = 0.8) -> CraftMeta:
    return CraftMeta(cci, (0.1, 0.3, 0.2), ids, inter, tuple(10 for _ in ids))


# --- the probed layer step ----------------------------------------------------------------


def test_probed_layer_step_returns_hugging_face_attention() -> None:
    hf = tiny_hf_model("llama")
    hf.set_attn_implementation("eager")
    lm = LoadedModel.from_hf(hf, tiny_tokenizer())
    ids = torch.tensor(random_ids(20, 5))
    expected = hf(ids[None], output_attentions=True).attentions  # per layer [1, H, S, S]
    kv = lm.new_kv(20)
    kv.extend(20)
    rows = Rows.build(torch.arange(20), 20, lm.rope)
    few = Probe(torch.tensor([0, 7, 19]), torch.arange(20), 20)  # one group per slot
    most = Probe(torch.arange(2, 20), torch.arange(20), 20)  # most rows: SDPA's causal path
    x = lm.decoder.embed_tokens(ids)
    for i, layer in enumerate(lm.decoder.layers):
        k, v = kv.layer(i)  # each step below writes the same K/V
        plain = layer_step(layer, x, rows, k, v)
        for probe in (few, most):
            out, probs = layer_step_probed(layer, x, rows, k, v, probe)
            assert torch.equal(out, plain)
            reference = expected[i][0, :, probe.rows].mean(0)  # [P, 20]
            torch.testing.assert_close(probs, reference, atol=1e-5, rtol=0)
        x = plain


def test_probed_rows_over_a_merged_sequence_sum_per_group() -> None:
    lm = tiny_lm("qwen2")
    kv = lm.new_kv(150)
    kv.extend(150)
    kv.k.normal_()
    kv.v.normal_()
    rows = Rows.build(torch.tensor([3, 10, 11, 149]), 150, lm.rope)
    x = torch.randn(4, lm.spec.hidden_size)
    k, v = kv.layer(0)
    layer = lm.decoder.layers[0]
    every = Probe(torch.tensor([1, 3]), torch.arange(150), 150)  # more groups than head_dim
    _, probs = layer_step_probed(layer, x, rows, k.clone(), v.clone(), every)
    torch.testing.assert_close(probs.sum(1), torch.ones(2))
    assert probs[0, 11:].abs().max() == 0  # slot 10 sees slots 0 ... 10 only
    groups = torch.arange(150) % 7
    _, mass = layer_step_probed(layer, x, rows, k, v, Probe(every.rows, groups, 7))
    expected = torch.zeros(2, 7).index_add_(1, groups, probs)
    torch.testing.assert_close(mass, expected)


# --- scores -------------------------------------------------------------------------------


def test_identical_context_keeps_everything() -> None:
    m = meta(("s", "c1", "c2"), (0.5, 1.0, 2.0))
    assert prefix_overlap(m, m.context_ids, m.context_tokens) == 1.0
    assert order_penalty(m.context_ids, m.context_ids) == 0.0
    assert fix_overhead(m, m.context_ids, m.context_tokens, alpha=1.0) == 0.0


def test_reordered_context_lowers_adjusted_overlap() -> None:
    # The paper's example: C3 cached after C1-C2, requested after C2-C1 (beta = 1, gamma = 1).
    m = meta(("c1", "c2"), (1.0, 2.0))
    assert prefix_overlap(m, ("c2", "c1"), (10, 10)) == 1.0
    assert order_penalty(("c1", "c2"), ("c2", "c1")) == 1.0
    assert adjusted_overlap(m, ("c2", "c1"), (10, 10)) < adjusted_overlap(m, ("c1", "c2"), (10, 10))
    # One swap among three shared segments: one discordant pair of three.
    assert order_penalty(("s", "c1", "c2"), ("s", "c2", "c1")) == pytest.approx(1 / 3)


def test_missing_and_unseen_context_lower_overlap() -> None:
    m = meta(("s", "c1", "c2"), (1.0, 1.0, 2.0))
    assert prefix_overlap(m, ("s", "c2"), (10, 10)) == pytest.approx(3 / 4)  # Eq. 6
    # c9 was never seen: it counts at the old context's mean mass per token (4 / 30).
    assert prefix_overlap(m, ("s", "c1", "c2", "c9"), (10, 10, 10, 15)) == pytest.approx(4 / 6)
    empty = meta((), ())
    assert prefix_overlap(empty, (), ()) == 1.0
    assert prefix_overlap(empty, ("s",), (5,)) == 0.0


def test_repeated_segments_match_occurrence_by_occurrence() -> None:
    m = meta(("sep", "c1", "sep"), (1.0, 1.0, 1.0))
    assert prefix_overlap(m, ("sep", "c1"), (10, 10)) == pytest.approx(2 / 3)  # one sep kept
    assert order_penalty(("sep", "c1", "sep"), ("sep", "c1", "sep")) == 0.0


def test_fix_overhead_scales_with_alpha_and_cci_and_is_clipped() -> None:
    m = meta(("c1", "c2"), (1.0, 2.0), cci=0.8)
    assert fix_overhead(m, ("c2", "c1"), (10, 10), alpha=1.0) == pytest.approx(0.8)
    assert fix_overhead(m, ("c2", "c1"), (10, 10), alpha=0.5) == pytest.approx(0.4)
    assert fix_overhead(m, ("c2", "c1"), (10, 10), alpha=5.0) == 1.0
    assert fix_overhead(None, ("c1",), (10,), alpha=0.3) == 0.3  # no metadata: worst case


def test_top_tokens_and_counts() -> None:
    m = meta(("c1",), (1.0,))
    assert top_tokens(m, 3, 2) == [1, 2]  # token_inter (0.1, 0.3, 0.2)
    assert top_tokens(None, 3, 2) == [0, 1]
    assert num_fix_tokens(0.1, 30) == 3
    assert num_fix_tokens(0.34, 3) == 2
    assert num_fix_tokens(0.0, 30) == 0
    assert fit_budget([10, 5, 0], 30) == [10, 5, 0]
    assert fit_budget([10, 5, 1], 8) == [5, 3, 0]
    assert sum(fit_budget([7, 7, 7], 10)) == 10


def test_meta_survives_json() -> None:
    m = meta(("s", "c1"), (0.25, 1.5))
    assert CraftMeta.from_json(json.loads(json.dumps(m.to_json()))) == m


def test_focused_chunks_follow_algorithm_1() -> None:
    assert focused_chunks([3.0, 1.0]) == {0, 1}  # too few chunks to split
    assert focused_chunks([2.0, 2.0, 2.0]) == {0, 1, 2}  # no gap at all
    # sorted 10, 9.5, 1, 0.8, 0.5: gaps .5 8.5 .2 .3, p = gaps / 9.5; the entropy gains
    # -p log p of gaps 2..4 are .0995 .0814 .1090: i* = 3, the top three chunks.
    assert focused_chunks([0.8, 10.0, 0.5, 1.0, 9.5]) == {1, 4, 3}
    # gaps 1, 3.8, .1 (p .204 .776 .020): gains .197 .079, i* = 1; the cut is not always at
    # the widest gap, as the paper's entropy rule has it.
    assert focused_chunks([5.0, 0.1, 4.0, 0.2]) == {0}


# --- metadata -----------------------------------------------------------------------------


def _probe_cci(own_share: float) -> float:
    """CCI of a 4-token chunk at slots 8-11 after a segment of attention sinks (0-3) and a
    context (4-7), whose tokens give ``own_share`` of their attention to their own chunk."""
    spans = [Span("sink", 0, 4), Span("x", 4, 8), Span("c", 8, 12)]
    probe = MetaProbe([2], spans, range(1), sinks=4)
    mass = torch.zeros(4, len(spans) + 1)  # groups: the spans, then the sinks
    mass[:, 1], mass[:, 2], mass[:, 3] = 1 - own_share, own_share, 0.5
    probe.add(mass)
    (m,) = probe.metas()
    assert m.context_ids == ("sink", "x")
    assert m.context_tokens == (0, 4)
    assert m.context_inter == pytest.approx((0, 4 * (1 - own_share)))
    assert m.token_inter == pytest.approx((1 - own_share,) * 4)
    return m.cci


def test_cci_is_higher_when_the_chunk_attends_to_its_context() -> None:
    self_contained, contextual = _probe_cci(0.9), _probe_cci(0.1)
    assert 0.5 < self_contained < contextual < 1.0
    assert self_contained == pytest.approx(1 / (1 + math.exp(-(0.4 / 16) / (3.6 / 16))))


def _content_attention_lm(seed: int) -> LoadedModel:
    """A one-layer tiny Llama whose queries and keys read the same hidden dimensions (on the
    slowest RoPE pairs, with RoPE theta 1e9): each token attends to copies of itself."""
    rope = {"rope_type": "default", "rope_theta": 1e9}
    hf = tiny_hf_model("llama", seed, num_hidden_layers=1, rope_parameters=rope)
    attn = hf.model.layers[0].self_attn
    with torch.no_grad():
        k = torch.zeros(32, 64)  # 2 KV heads x 16 dims over 64 hidden dims
        rows = [16 * j + d for j in range(2) for d in (*range(3, 8), *range(11, 16))]
        k[rows, range(len(rows))] = 1.0
        attn.k_proj.weight.copy_(k)
        attn.q_proj.weight.copy_(5.0 * k.view(2, 16, 64).repeat_interleave(2, dim=0).flatten(0, 1))
    return LoadedModel.from_hf(hf, tiny_tokenizer())


@pytest.mark.parametrize("seed", [0, 1])
def test_cci_of_a_chunk_that_echoes_its_context(seed: int) -> None:
    lm = _content_attention_lm(seed)
    context = text(list(range(20, 36)))
    ccis = {}
    for name, ids in [("echo", list(range(20, 36))), ("own", list(range(50, 66)))]:
        engine = ChunkEngine(lm, craft=CraftConfig(meta_layer_stride=1))
        engine.prefill([SYSTEM, context, chunk(name, ids), QUESTION], "cachecraft")
        (variant,) = engine.store.variants(lm.fingerprint, name)
        assert variant.meta is not None
        ccis[name] = variant.meta.cci
    assert 0.5 < ccis["own"] < ccis["echo"] < 1.0


def test_chunks_computed_fresh_get_metadata(lm: LoadedModel) -> None:
    engine = ChunkEngine(lm)
    engine.prefill([SYSTEM, A, B, QUESTION], "cachecraft")
    (variant,) = engine.store.variants(lm.fingerprint, B.segment_id)
    m = variant.meta
    assert m is not None and 0.5 < m.cci < 1.0
    assert m.context_ids == (SYSTEM.segment_id, A.segment_id)
    assert m.context_tokens == (len(SYSTEM.ids) - 4, len(A.ids))  # 4 attention sinks
    assert len(m.token_inter) == len(B.ids)
    assert all(0 <= score <= 1 for score in m.token_inter)
    assert sum(m.context_inter) == pytest.approx(sum(m.token_inter))
    (plain,) = engine.store.variants(lm.fingerprint, SYSTEM.segment_id)
    assert plain.meta is None  # text segments are prefix hits only
    other = ChunkEngine(lm)
    other.prefill([SYSTEM, A, QUESTION], "cacheblend")
    assert other.store.variants(lm.fingerprint, A.segment_id)[0].meta is None


# --- the policy ---------------------------------------------------------------------------


def full_logits(lm: LoadedModel, segments: list[TokenSegment]) -> torch.Tensor:
    return ChunkEngine(lm).prefill(segments, "full").logits


def assert_exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert (actual - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("history", ["cachecraft", "full"])
def test_cfo_one_equals_full_prefill(lm: LoadedModel, history: str) -> None:
    engine = ChunkEngine(lm, craft=CraftConfig(alpha=1e9, focus_window=None))
    engine.prefill([A, QUESTION], history)  # type: ignore[arg-type]
    engine.prefill([B, QUESTION], history)  # type: ignore[arg-type]
    request = [SYSTEM, B, A, C, QUESTION]  # A, B cached at other positions, C a miss
    out = engine.prefill(request, "cachecraft", ratio=1.0)
    assert out.stats.extra["craft_cfo"] == [1.0, 1.0]
    assert out.stats.recomputed_tokens == len(A.ids) + len(B.ids)
    assert_exact(out.logits, full_logits(lm, request))


def test_alpha_zero_equals_reuse(lm: LoadedModel) -> None:
    request = [SYSTEM, B, A, C, QUESTION]
    logits = {}
    for policy, config in [("reuse", CraftConfig()), ("cachecraft", CraftConfig(alpha=0.0))]:
        engine = ChunkEngine(lm, craft=config)
        engine.prefill([SYSTEM, A, QUESTION], "cachecraft")
        engine.prefill([OTHER_SYSTEM, B, QUESTION], "cachecraft")
        out = engine.prefill(request, policy, ratio=1.0)  # type: ignore[arg-type]
        assert out.stats.recomputed_tokens == 0
        logits[policy] = out.logits
    assert_exact(logits["cachecraft"], logits["reuse"])


def test_the_variant_of_lowest_cfo_is_reused_and_counted(lm: LoadedModel) -> None:
    store = MemoryKVStore()
    for history in ([SYSTEM, C, A, QUESTION], [SYSTEM, B, A, QUESTION]):
        engine = ChunkEngine(lm)
        engine.prefill(history, "cachecraft")
        store.put(lm.fingerprint, engine.store.variants(lm.fingerprint, A.segment_id)[0])
    variants = store.variants(lm.fingerprint, A.segment_id)
    assert [v.meta.context_ids[1] for v in variants if v.meta] == [B.segment_id, C.segment_id]
    request = [OTHER_SYSTEM, C, A, QUESTION]  # keeps C of the second variant, nothing of the first
    context = ((OTHER_SYSTEM.segment_id, C.segment_id), (len(OTHER_SYSTEM.ids) - 4, len(C.ids)))
    cfos = [fix_overhead(v.meta, *context, alpha=1.0) for v in variants]
    assert cfos[1] < cfos[0]
    out = ChunkEngine(lm, store, craft=NO_FOCUS).prefill(request, "cachecraft", ratio=1.0)
    assert out.stats.extra["craft_cfo"] == [round(cfos[1], 4)]
    assert out.stats.recomputed_tokens == num_fix_tokens(cfos[1], len(A.ids))
    assert (variants[0].reuse.num_reuses, variants[1].reuse.num_reuses) == (0, 1)
    assert variants[1].reuse.frequency_reuse == pytest.approx(1 / cfos[1])


def test_a_variant_in_its_own_context_is_reused_as_is(lm: LoadedModel) -> None:
    request = [SYSTEM, B, A, QUESTION]
    engine = ChunkEngine(lm)
    engine.prefill(request, "cachecraft")
    store = MemoryKVStore()  # only A's variant: SYSTEM and B are computed again
    store.put(lm.fingerprint, engine.store.variants(lm.fingerprint, A.segment_id)[0])
    out = ChunkEngine(lm, store).prefill(request, "cachecraft", ratio=1.0)
    assert out.stats.extra["craft_cfo"] == [0.0]
    assert out.stats.recomputed_tokens == 0
    assert out.stats.reused_tokens == len(A.ids)
    assert_exact(out.logits, full_logits(lm, request))
    (variant,) = store.variants(lm.fingerprint, A.segment_id)
    assert variant.reuse.num_reuses == 1  # counted (f_r), as any reuse: eviction reads it


@pytest.mark.parametrize("ratio", [0.2, 1.0])
def test_stats_add_up(lm: LoadedModel, ratio: float) -> None:
    engine = ChunkEngine(lm, craft=NO_FOCUS)
    engine.prefill([SYSTEM, A, QUESTION], "cachecraft")
    engine.prefill([SYSTEM, B, QUESTION], "cachecraft")
    out = engine.prefill([SYSTEM, D, B, A, C, QUESTION], "cachecraft", ratio=ratio)
    stats = out.stats
    assert (stats.chunk_hits, stats.chunk_misses) == (2, 2)
    total = stats.reused_tokens + stats.recomputed_tokens + stats.computed_tokens
    assert total == stats.prompt_tokens
    reused = len(A.ids) + len(B.ids)
    wanted = sum(num_fix_tokens(cfo, 17) for cfo in stats.extra["craft_cfo"])
    budget = math.floor(blend_share(ratio, lm.spec.num_layers, kv_write_share(lm)) * reused)
    assert stats.recomputed_tokens == min(wanted, budget)
    assert stats.recomputed_tokens > 0
    share = (stats.computed_tokens + stats.recomputed_tokens) / stats.prompt_tokens
    assert stats.extra["token_layer_share"] == pytest.approx(share)
    assert torch.isfinite(out.logits).all()


def test_early_termination_drops_unfocused_chunks() -> None:
    hf = tiny_hf_model("llama", 3, num_hidden_layers=10)
    lm = LoadedModel.from_hf(hf, tiny_tokenizer())
    request = [SYSTEM, D, C, B, A, QUESTION]
    runs = {}
    for window in (None, 2):
        engine = ChunkEngine(lm, craft=CraftConfig(alpha=1e9, focus_window=window))
        for piece in (A, B, C, D):
            engine.prefill([piece, QUESTION], "cachecraft")
        runs[window] = engine.prefill(request, "cachecraft", ratio=1.0).stats
    every, focused = runs[None], runs[2]
    assert every.recomputed_tokens == 4 * 17
    cutoff = focused.extra["craft_focus_layer"]
    assert cutoff is not None and cutoff < lm.spec.num_layers - 1
    assert 0 < focused.recomputed_tokens < every.recomputed_tokens
    assert focused.recomputed_tokens % 17 == 0  # whole chunks stop
    total = focused.reused_tokens + focused.recomputed_tokens + focused.computed_tokens
    assert total == focused.prompt_tokens
    assert every.extra["token_layer_share"] > focused.extra["token_layer_share"]

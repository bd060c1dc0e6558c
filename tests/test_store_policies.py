"""Eviction policies on small hand-made traces: each evicts what its paper says."""

from __future__ import annotations

import pytest
from test_store_support import FP, make_variant

from chunkcache.core.store import MemoryTier, PrefillCostModel, TieredKVStore, make_policy
from chunkcache.core.store.policies import EntryStats, PGDSFPolicy

SIZE = make_variant("x").num_bytes


def three_slots(policy: str) -> TieredKVStore:
    """One host tier with room for exactly three variants."""
    return TieredKVStore([MemoryTier("host", 3 * SIZE)], policy=policy)


def held(store: TieredKVStore) -> set[str]:
    return {s for s in "abcdefghij" if store.exact(FP, s, "root") is not None}


def put_all(store: TieredKVStore, names: str) -> None:
    for name in names:
        store.put(FP, make_variant(name))


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo")


def test_lru_evicts_the_least_recently_used() -> None:
    store = three_slots("lru")
    put_all(store, "abc")
    store.exact(FP, "a", "root")
    store.put(FP, make_variant("d"))
    assert held(store) == {"a", "c", "d"}


def test_lfu_evicts_the_least_frequently_used() -> None:
    store = three_slots("lfu")
    put_all(store, "abc")
    for name in "aaaccb":  # b is the most recent, but the least frequent
        store.exact(FP, name, "root")
    store.put(FP, make_variant("d"))
    assert held(store) == {"a", "c", "d"}


def test_pgdsf_evicts_the_cheapest_to_recompute() -> None:
    """RAGCache Formula 2 with 4: equal frequency and size, so the entry whose measured
    prefill cost per token is lowest goes, not the oldest one (which LRU would evict)."""
    store = three_slots("pgdsf")
    put_all(store, "abc")
    for name, seconds in (("a", 4.0), ("b", 0.4), ("c", 2.0)):  # 4 new tokens each
        store.record_prefill(FP, [(name, "root")], cached_tokens=0, new_tokens=4, seconds=seconds)
    store.put(FP, make_variant("d"))
    assert held(store) == {"a", "c", "d"}
    policy = store.policies[0]
    assert isinstance(policy, PGDSFPolicy)
    assert policy.clock == pytest.approx(0.1)  # Formula 3: the evicted priority, 1 x 0.4 / 4


def test_pgdsf_clock_ages_out_a_once_popular_entry() -> None:
    """Formula 3: the clock rises with every eviction, so new entries eventually outrank an
    entry that was popular long ago; LFU keeps such an entry forever."""
    pgdsf, lfu = three_slots("pgdsf"), three_slots("lfu")
    for store in (pgdsf, lfu):
        put_all(store, "abc")
        for _ in range(3):
            store.exact(FP, "a", "root")  # a: frequency 4, then never again
        put_all(store, "defghij")
    assert "a" in held(lfu)
    assert "a" not in held(pgdsf)


def test_pgdsf_keeps_the_frequent_entry_against_one_newcomer() -> None:
    store = three_slots("pgdsf")
    put_all(store, "abc")
    store.exact(FP, "a", "root")
    store.exact(FP, "c", "root")
    store.put(FP, make_variant("d"))
    assert held(store) == {"a", "c", "d"}


def test_pgdsf_cost_per_token_is_the_mean_over_missing_requests() -> None:
    """Formula 4 / Figure 11: one chunk costs a different time per new token depending on
    what was cached before it; the estimate is the mean of Cost_i / NewSize_i."""
    stats = EntryStats(num_bytes=SIZE, num_tokens=4)
    assert stats.cost_per_token is None
    stats.record_cost(2.0, 8)  # [S, D1, D2, Q] with only S cached: 8 new tokens
    stats.record_cost(1.0, 2)  # [S, D1] cached: D2 and Q only
    assert stats.cost_per_token == pytest.approx((0.25 + 0.5) / 2)


def test_prefill_cost_model_interpolates_bilinearly() -> None:
    """Algorithm 1 lines 6-7: T(alpha, beta) from the four surrounding profile points."""
    model = PrefillCostModel([(0, 100, 1.0), (0, 200, 2.0), (100, 100, 1.5), (100, 200, 3.0)])
    assert model.estimate(0, 100) == pytest.approx(1.0)
    assert model.estimate(50, 150) == pytest.approx((1.0 + 2.0 + 1.5 + 3.0) / 4)
    assert model.estimate(100, 150) == pytest.approx(2.25)
    assert model.per_token(0, 200) == pytest.approx(0.01)
    assert model.estimate(0, 1000) == pytest.approx(2.0)  # clamped to the grid's edge


def test_cachecraft_evicts_the_lowest_frequency_reuse() -> None:
    """Cache-Craft §3.3: f_r += 1 / CFO on each reuse; the lowest f_r goes first, however
    recently it was used."""
    store = three_slots("cachecraft")
    put_all(store, "abc")
    (a,) = store.variants(FP, "a")
    (b,) = store.variants(FP, "b")
    a.reuse.record(0.5)  # f_r = 2
    b.reuse.record(0.05)  # f_r = 20
    store.variants(FP, "c")  # c is the most recent, never reused: f_r = 0
    store.put(FP, make_variant("d"))
    assert held(store) == {"a", "b", "d"}
    (d,) = store.variants(FP, "d")
    d.reuse.record(0.01)  # f_r = 100
    store.put(FP, make_variant("e"))
    assert "a" not in held(store) and {"b", "d"} <= held(store)


def test_cachecraft_keeps_good_variants_of_one_chunk() -> None:
    """N x M variants: several contexts of one chunk compete on f_r like any entries."""
    store = three_slots("cachecraft")
    for ctx in ("c1", "c2", "c3"):
        store.put(FP, make_variant("a", ctx, exact=False))
    by_ctx = {v.context: v for v in store.variants(FP, "a")}
    by_ctx["c1"].reuse.record(0.1)
    by_ctx["c3"].reuse.record(0.2)
    store.put(FP, make_variant("a", "c4", exact=False))
    assert {v.context for v in store.variants(FP, "a")} == {"c1", "c3", "c4"}

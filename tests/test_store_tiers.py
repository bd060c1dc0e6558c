"""Tiered store: placement, promotion, swap-out-only-once demotion, capacity, metrics."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_store_support import FP, make_variant, same_kv, tree_bytes

from chunkcache.core.kv_store import KVStore
from chunkcache.core.store import DiskTier, MemoryTier, TieredKVStore, delta
from chunkcache.core.store.tier import Tier

VARIANT_BYTES = make_variant("x").num_bytes  # 256


def host_disk(tmp_path: Path, host_entries: int = 2, disk_bytes: int = 100_000) -> TieredKVStore:
    host = MemoryTier("host", host_entries * VARIANT_BYTES)
    return TieredKVStore([host, DiskTier(tmp_path / "kv", disk_bytes)], policy="lru")


def test_is_a_kv_store(tmp_path: Path) -> None:
    store: KVStore = host_disk(tmp_path)
    a = make_variant("a")
    store.put(FP, a)
    assert same_kv(store.exact(FP, "a", a.context), a)
    assert store.exact(FP, "a", "another context") is None
    assert [v.context for v in store.variants(FP, "a")] == [a.context]


def test_approximate_variant_is_no_exact_hit(tmp_path: Path) -> None:
    store = host_disk(tmp_path)
    store.put(FP, make_variant("a", "ctx", exact=False))
    assert store.exact(FP, "a", "ctx") is None
    assert len(store.variants(FP, "a")) == 1


def test_variants_are_most_recently_used_first(tmp_path: Path) -> None:
    store = host_disk(tmp_path, host_entries=8)
    for ctx in ("c1", "c2", "c3"):
        store.put(FP, make_variant("a", ctx))
    store.exact(FP, "a", "c1")
    assert [v.context for v in store.variants(FP, "a")] == ["c1", "c3", "c2"]


def test_eviction_demotes_and_a_hit_promotes(tmp_path: Path) -> None:
    store = host_disk(tmp_path)
    a, b, c = (make_variant(s, seed=i) for i, s in enumerate("abc"))
    for v in (a, b, c):
        store.put(FP, v)
    host, disk = store.tiers
    assert isinstance(host, MemoryTier)
    assert {k.segment for k in host.entry_keys()} == {_seg("b"), _seg("c")}
    assert len(disk) == 1  # a went down, not away
    got = store.exact(FP, "a", a.context)
    assert same_kv(got, a)
    m = store.metrics()["tiers"]
    assert m["disk"]["hits"] == 1 and m["host"]["misses"] == 1
    assert m["disk"]["promotions"] == 1 and m["disk"]["load_seconds"] > 0
    assert any(k.segment == _seg("a") for k in host.entry_keys())


def test_swap_out_only_once(tmp_path: Path) -> None:
    """RAGCache §5.1: an entry already copied below is freed, not copied again."""
    store = host_disk(tmp_path, host_entries=1)
    a, b = make_variant("a"), make_variant("b", seed=1)
    store.put(FP, a)
    store.put(FP, b)  # a -> disk (the one copy)
    header = next((tmp_path / "kv").rglob("*.json"))
    written = header.stat().st_mtime_ns
    store.exact(FP, "a", a.context)  # promoted: host a, disk a; b -> disk
    store.exact(FP, "b", b.context)  # promoted: a evicted from host, already on disk
    m = store.metrics()["tiers"]["host"]
    assert m["evictions"] == 3 and m["demotions"] == 2  # a once, b once
    assert header.stat().st_mtime_ns == written
    assert len(store.tiers[1]) == 2


def test_too_big_for_host_goes_to_disk(tmp_path: Path) -> None:
    store = host_disk(tmp_path, host_entries=1)
    big = make_variant("big", num_tokens=40)
    store.put(FP, big)
    assert len(store.tiers[0]) == 0 and len(store.tiers[1]) == 1
    assert same_kv(store.exact(FP, "big", big.context), big)


def test_last_tier_drops(tmp_path: Path) -> None:
    store = TieredKVStore([MemoryTier("host", 2 * VARIANT_BYTES)])
    for s in "abc":
        store.put(FP, make_variant(s))
    assert store.exact(FP, "a", "root") is None
    assert store.metrics()["tiers"]["host"]["evictions"] == 1


@pytest.mark.parametrize("policy", ["lru", "lfu", "pgdsf", "cachecraft"])
def test_capacity_is_never_exceeded(tmp_path: Path, policy: str) -> None:
    rng = random.Random(7)
    host = MemoryTier("host", 1000)
    disk = DiskTier(tmp_path / "kv", 6000)
    store = TieredKVStore([host, disk], policy=policy)
    names = [f"s{i}" for i in range(30)]
    for step in range(300):
        name = rng.choice(names)
        if rng.random() < 0.4:
            store.put(FP, make_variant(name, num_tokens=rng.randint(1, 12), seed=step))
        elif rng.random() < 0.5:
            store.exact(FP, name, "root")
        else:
            for v in store.variants(FP, name):
                v.reuse.record(rng.random())
        assert host.num_bytes <= host.capacity_bytes
        assert disk.num_bytes <= disk.capacity_bytes
        assert tree_bytes(tmp_path / "kv") <= disk.capacity_bytes
    m = store.metrics()["tiers"]
    assert m["host"]["evictions"] > 0 and m["disk"]["evictions"] > 0


def test_per_request_usage_and_delta(tmp_path: Path) -> None:
    store = host_disk(tmp_path, host_entries=1)
    store.put(FP, make_variant("a"))
    store.put(FP, make_variant("b"))
    before = store.snapshot()
    with store.track() as usage:
        store.exact(FP, "a", "root")
        store.exact(FP, "zzz", "root")
    got = usage.as_dict()
    assert got["lookups"] == 2 and got["hits"] == 1 and got["misses"] == 1
    assert got["tiers"]["disk"]["hits"] == 1 and got["tiers"]["disk"]["misses"] == 1
    assert got["tiers"]["host"]["misses"] == 2
    d = delta(before, store.snapshot())
    assert d["lookups"] == 2 and d["tiers"]["disk"]["promotions"] == 1
    store.exact(FP, "a", "root")  # outside the request: not counted in it
    assert usage.as_dict()["lookups"] == 2


def test_reuse_counter_survives_demotion(tmp_path: Path) -> None:
    store = host_disk(tmp_path, host_entries=1)
    a = make_variant("a", "ctx", exact=False)
    store.put(FP, a)
    store.variants(FP, "a")[0].reuse.record(0.5)  # what the cachecraft planner does
    store.put(FP, make_variant("b"))  # a -> disk with its counters
    reopened = TieredKVStore([DiskTier(tmp_path / "kv", 100_000)])
    (again,) = reopened.variants(FP, "a")
    assert again.reuse.num_reuses == 1 and again.reuse.frequency_reuse == pytest.approx(2.0)


def test_prefetch_moves_hits_up(tmp_path: Path) -> None:
    store = host_disk(tmp_path, host_entries=4)
    disk_only = TieredKVStore([DiskTier(tmp_path / "kv", 100_000)])
    for s in "ab":
        disk_only.put(FP, make_variant(s))
    assert store.prefetch(FP, ["a", "b", "missing"]).result(timeout=30) == 2
    assert len(store.tiers[0]) == 2
    with store.track() as usage:
        assert store.exact(FP, "a", "root") is not None
    assert usage.as_dict()["tiers"] == {"host": {"hits": 1}}
    store.close()


def _seg(segment_id: str) -> str:
    from chunkcache.core.store.codec import segment_of

    return segment_of(segment_id)


def test_demotion_keeps_each_entrys_own_fingerprint(tmp_path: Path) -> None:
    """A put for model A that evicts model B's entry demotes it under B, readable by B."""
    store = host_disk(tmp_path, host_entries=1)
    b = make_variant("shared-chunk", seed=1)
    store.put("model-B", b)
    store.put("model-A", make_variant("other", seed=2))  # evicts B's entry to disk
    reopened = TieredKVStore([DiskTier(tmp_path / "kv", 100_000)])
    assert same_kv(reopened.exact("model-B", "shared-chunk", "root"), b)
    assert reopened.exact("model-A", "shared-chunk", "root") is None
    assert reopened.metrics()["corrupt_dropped"] == 0


def test_drop_listeners_hear_what_leaves_the_store(tmp_path: Path) -> None:
    store = TieredKVStore([MemoryTier("host", 2 * VARIANT_BYTES)])
    gone: list[tuple[str, str, str]] = []
    store.drop_listeners.append(lambda *names: gone.append(names))
    for s in "abc":
        store.put(FP, make_variant(s, "ctx-" + s))
    assert gone == [(FP, "a", "ctx-a")]
    assert len(store.stats) == 2  # the dropped entry's statistics are gone too


def test_threads_never_see_wrong_kv_or_exceed_capacity(tmp_path: Path) -> None:
    """Requests on several threads plus background write-through and prefetch."""
    import threading

    host = MemoryTier("host", 6 * VARIANT_BYTES)
    disk = DiskTier(tmp_path / "kv", 12_000)
    store = TieredKVStore([host, disk], policy="pgdsf", write_through=True)
    seeds = {f"s{i}": i for i in range(20)}
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        rng = random.Random(worker)
        try:
            for _ in range(150):
                name = rng.choice(list(seeds))
                expected = make_variant(name, seed=seeds[name])
                action = rng.random()
                if action < 0.3:
                    store.put(FP, expected)
                elif action < 0.6:
                    got = store.exact(FP, name, "root")
                    assert got is None or same_kv(got, expected)
                elif action < 0.9:
                    for v in store.variants(FP, name):
                        assert same_kv(v, expected)
                else:
                    store.prefetch(FP, [name])
                assert host.num_bytes <= host.capacity_bytes
                assert disk.num_bytes <= disk.capacity_bytes
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.close()
    assert errors == []
    assert tree_bytes(tmp_path / "kv") <= disk.capacity_bytes
    assert store.metrics()["corrupt_dropped"] == 0


def test_statistics_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries only a self-evicting tier (Redis) holds, which may be gone without notice,
    do not keep their statistics forever."""
    import chunkcache.core.store.tiered_stats as tiered_stats

    class ForgetfulTier(MemoryTier):  # a tier that evicts on its own, like Redis
        self_evicting = True

        def put(self, *args: object, **kwargs: object) -> bool:
            return True  # accepted, then evicted at once without telling anyone

    monkeypatch.setattr(tiered_stats, "STATS_SLACK", 5)
    host = MemoryTier("host", 2 * VARIANT_BYTES)
    store = TieredKVStore([host, ForgetfulTier("shared", 10**6)], write_through=False)
    for i in range(40):
        store.put(FP, make_variant(f"s{i}"))
        assert len(store.stats) <= 2 * (len(host) + 5) + 1
    assert store.metrics()["tiers"]["host"]["demotions"] == 38


def test_a_closed_store_still_takes_work_inline(tmp_path: Path) -> None:
    """A server shutting down closes the store while a request may still finish: its
    write-through, prefetch and flush run inline instead of failing on the closed pool."""
    tiers: list[Tier] = [MemoryTier("host", 10**6), DiskTier(tmp_path, 10**6)]
    store = TieredKVStore(tiers, write_through=True)
    store.close()
    a = make_variant("a")
    store.put(FP, a)
    store.flush()
    assert store.prefetch(FP, ["a"]).result() == 0  # already at the top
    assert same_kv(TieredKVStore([DiskTier(tmp_path, 10**6)]).exact(FP, "a", "root"), a)

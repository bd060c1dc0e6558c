"""Disk hits read layer by layer behind compute: same bits, lazy reads, per-layer checksums."""

from __future__ import annotations

import json
import shutil
import struct
import threading
from pathlib import Path

import pytest
import torch
from test_store_support import FP, make_variant
from tiny_models import chunk, random_ids, text, tiny_hf_model, tiny_tokenizer

from chunkcache.core.chunk_placing import pipelines_lower_tier_reads
from chunkcache.core.engine import ChunkEngine, Prefilled
from chunkcache.core.generation import Policy
from chunkcache.core.models import LoadedModel
from chunkcache.core.store import CorruptEntryError, DiskTier, MemoryTier, TieredKVStore, codec
from chunkcache.core.store.disk import LAYOUT
from chunkcache.core.store.layer_file import LayerFile
from chunkcache.core.store.lazy import LayerReadError, LazyKVVariant
from chunkcache.core.store.loading import LayerLoader

NUM_LAYERS = 6
SYSTEM = text(random_ids(6, seed=1))
A = chunk("a", random_ids(20, seed=2))
B = chunk("b", random_ids(24, seed=3))
QUESTION = text(random_ids(5, seed=4))
OTHER = text(random_ids(3, seed=5))
REQUEST = [SYSTEM, OTHER, B, A, QUESTION]  # A and B move: placed from variants(), no prefix


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return LoadedModel.from_hf(
        tiny_hf_model("llama", 0, num_hidden_layers=NUM_LAYERS), tiny_tokenizer()
    )


def write_chunks(lm: LoadedModel, root: Path, policy: Policy) -> None:
    """A and B computed fresh after the system prompt, stored on disk only."""
    engine = ChunkEngine(lm, TieredKVStore([DiskTier(root, 10**8)]))
    for segment in (A, B):
        engine.prefill([SYSTEM, segment, QUESTION], policy)


def host_and_disk(root: Path) -> TieredKVStore:
    return TieredKVStore([MemoryTier("host", 10**8), DiskTier(root, 10**8)])


def run(lm: LoadedModel, store: TieredKVStore, policy: Policy, piped: bool) -> Prefilled:
    return ChunkEngine(lm, store, layer_loading=piped).prefill(REQUEST, policy, ratio=0.3)


def data_file(root: Path, segment_id: str) -> Path:
    for header in root.rglob("*.json"):
        if not header.name.startswith(".") and json.loads(header.read_text())["segment_id"] == (
            segment_id
        ):
            return header.with_suffix(".safetensors")
    raise AssertionError(f"no stored entry for {segment_id}")


def flip_in_layer(path: Path, name: str, layer: int) -> None:
    """Flip one bit inside layer ``layer`` of tensor ``name`` of a stored data file."""
    raw = bytearray(path.read_bytes())
    (length,) = struct.unpack_from("<Q", raw)
    entry = json.loads(raw[8 : 8 + length])[name]
    begin, end = entry["data_offsets"]
    layer_bytes = (end - begin) // entry["shape"][0]
    raw[8 + length + begin + layer * layer_bytes + 5] ^= 0x10
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("policy", ["reuse", "cacheblend", "cachecraft"])
def test_pipelined_disk_hits_give_the_bits_of_host_hits(
    lm: LoadedModel, tmp_path: Path, policy: Policy
) -> None:
    write_chunks(lm, tmp_path, policy)
    host = host_and_disk(tmp_path)
    segments = [SYSTEM.segment_id, "a", "b"]
    assert host.prefetch(lm.fingerprint, segments).result() == 3  # whole, in host memory
    on_host = run(lm, host, policy, piped=True)
    disk = host_and_disk(tmp_path)
    on_disk = run(lm, disk, policy, piped=True)
    plain = run(lm, host_and_disk(tmp_path), policy, piped=False)  # read whole, then compute

    tiers = on_disk.stats.extra["store"]["tiers"]
    assert tiers["disk"]["hits"] == 3  # A, B lazily; the system prompt (a prefix) whole
    assert "hits" not in on_host.stats.extra["store"]["tiers"]["disk"]
    assert on_disk.stats.extra["layer_loading"]["ratio"] == (0.0 if policy == "reuse" else 0.3)
    for other in (on_host, plain):
        assert torch.equal(on_disk.logits, other.logits)
        assert torch.equal(on_disk.kv.keys(), other.kv.keys())
        assert torch.equal(on_disk.kv.values(), other.kv.values())
    # every layer was read (in the loader thread, counted for this request), then promoted:
    # A and B lazily, the system prompt whole (an exact prefix hit)
    per_token = 2 * NUM_LAYERS * lm.spec.num_kv_heads * lm.spec.head_dim * 4  # k and v, fp32
    assert tiers["disk"]["bytes_loaded"] == per_token * sum(len(g.ids) for g in (SYSTEM, A, B))
    assert tiers["disk"]["promotions"] == 3 and tiers["disk"]["load_seconds"] > 0
    again = run(lm, disk, policy, piped=True).stats.extra["store"]["tiers"]
    assert again["host"]["hits"] == 4 and "hits" not in again["disk"]  # OTHER was stored


def test_on_the_cpu_disk_hits_are_read_whole_by_default(lm: LoadedModel, tmp_path: Path) -> None:
    write_chunks(lm, tmp_path, "cacheblend")
    engine = ChunkEngine(lm, host_and_disk(tmp_path))  # layer_loading=None
    default = engine.prefill(REQUEST, "cacheblend", ratio=0.3)
    whole = run(lm, host_and_disk(tmp_path), "cacheblend", piped=False)

    assert default.stats.extra["store"]["tiers"]["disk"]["hits"] == 3
    assert "layer_loading" not in default.stats.extra  # no loader thread, no ratio raised
    assert default.stats.recomputed_tokens == whole.stats.recomputed_tokens
    assert torch.equal(default.logits, whole.logits)


def test_a_request_whose_only_disk_reads_are_lazy_runs(lm: LoadedModel, tmp_path: Path) -> None:
    # Another system prompt: nothing is read whole from disk (no prefix hit), A and B are
    # opened lazily, so the disk tier has time but no bytes yet when the request is planned.
    # Its bandwidth was then 0 and the loading controller divided by it (seen in CI).
    write_chunks(lm, tmp_path, "cacheblend")
    request = [OTHER, B, A, QUESTION]
    default = ChunkEngine(lm, host_and_disk(tmp_path)).prefill(request, "cacheblend", ratio=0.3)
    piped = ChunkEngine(lm, host_and_disk(tmp_path), layer_loading=True)
    pipelined = piped.prefill(request, "cacheblend", ratio=0.3)

    for done in (default, pipelined):
        assert done.stats.extra["store"]["tiers"]["disk"]["hits"] == 2  # A and B, lazily
    assert torch.equal(default.logits, pipelined.logits)


def test_only_a_model_off_the_cpu_pipelines_lower_tier_reads_by_default() -> None:
    assert not pipelines_lower_tier_reads(torch.device("cpu"))
    assert pipelines_lower_tier_reads(torch.device("cuda", 0))
    assert pipelines_lower_tier_reads(torch.device("mps"))


def test_layers_are_read_only_as_compute_reaches_them(
    lm: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_chunks(lm, tmp_path, "reuse")
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    read, wait = LayerFile.read, LayerLoader.wait

    def logged_read(self: LayerFile, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        with lock:
            events.append(("read", layer))
        read(self, layer, k, v)

    def logged_wait(self: LayerLoader, layer: int) -> None:
        with lock:
            events.append(("compute", layer))
        wait(self, layer)

    monkeypatch.setattr(LayerFile, "read", logged_read)
    monkeypatch.setattr(LayerLoader, "wait", logged_wait)
    out = run(lm, host_and_disk(tmp_path), "reuse", piped=True)

    assert out.stats.extra["layer_loading"]["depth"] == 1  # a new store: no prefill profile
    reads = [layer for kind, layer in events if kind == "read"]
    assert sorted(reads) == sorted(list(range(NUM_LAYERS)) * 2)  # each layer of A and B once
    reached = -1  # the layer compute has reached
    for kind, layer in events:
        if kind == "compute":
            reached = max(reached, layer)
        else:  # read layer l only once compute reached l - depth
            assert layer <= max(reached, 0) + 1, events
    assert events.index(("read", NUM_LAYERS - 1)) > events.index(("compute", NUM_LAYERS - 2))


@pytest.mark.parametrize("corrupt", [("a",), ("a", "b")])
@pytest.mark.parametrize("piped", [True, False])
def test_a_corrupt_layer_found_mid_prefill_reruns_the_request_without_it(
    lm: LoadedModel, tmp_path: Path, piped: bool, corrupt: tuple[str, ...]
) -> None:
    write_chunks(lm, tmp_path / "kv", "reuse")
    for name in ("bad", "without"):
        shutil.copytree(tmp_path / "kv", tmp_path / name)
    bad_files = [data_file(tmp_path / "bad", segment) for segment in corrupt]
    for bad_file in bad_files:
        flip_in_layer(bad_file, "v", NUM_LAYERS - 2)  # layers 0..3 pass: found mid-prefill
    for segment in corrupt:
        gone = data_file(tmp_path / "without", segment)
        gone.with_suffix(".json").unlink()
        gone.unlink()

    store = host_and_disk(tmp_path / "bad")
    bad = run(lm, store, "reuse", piped)  # one rerun per corrupt entry
    expected = run(lm, host_and_disk(tmp_path / "without"), "reuse", piped)

    assert store.metrics()["corrupt_dropped"] == len(corrupt)
    assert bad.stats.extra["store"]["tiers"]["disk"]["corrupt_dropped"] == len(corrupt)
    assert not any(f.exists() or f.with_suffix(".json").exists() for f in bad_files)
    assert (bad.stats.chunk_hits, bad.stats.chunk_misses) == (2 - len(corrupt), len(corrupt))
    assert torch.equal(bad.logits, expected.logits)
    assert torch.equal(bad.kv.keys(), expected.kv.keys())
    # the recomputed chunks were stored again, sound: the next request hits both
    assert run(lm, store, "reuse", piped).stats.chunk_hits == 2
    assert store.metrics()["corrupt_dropped"] == len(corrupt)


def test_many_corrupt_variants_of_one_chunk_are_each_dropped_and_rerun(
    lm: LoadedModel, tmp_path: Path
) -> None:
    """More corrupt entries than the prompt has segments: one rerun per entry met."""
    writer = ChunkEngine(lm, TieredKVStore([DiskTier(tmp_path, 10**8)]))
    for seed in range(5):  # B after five other prefixes: five variants of one chunk
        writer.prefill([text(random_ids(3, seed=100 + seed)), B, QUESTION], "full")
    headers = [h for h in tmp_path.rglob("*.json") if not h.name.startswith(".")]
    for header in headers:
        if json.loads(header.read_text())["segment_id"] == B.segment_id:
            flip_in_layer(header.with_suffix(".safetensors"), "v", NUM_LAYERS - 2)
    store = host_and_disk(tmp_path)
    out = ChunkEngine(lm, store, layer_loading=True).prefill([SYSTEM, B, QUESTION], "reuse")
    assert (out.stats.chunk_hits, out.stats.chunk_misses) == (0, 1)
    assert store.metrics()["corrupt_dropped"] >= 1


def test_a_corrupt_layer_raises_before_it_is_handed_out(tmp_path: Path) -> None:
    store = TieredKVStore([MemoryTier("host", 10**6), DiskTier(tmp_path, 10**6)])
    TieredKVStore([DiskTier(tmp_path, 10**6)]).put(FP, make_variant("a", num_tokens=8))
    flip_in_layer(data_file(tmp_path, "a"), "k", 1)
    (variant,) = store.variants(FP, "a")
    assert isinstance(variant, LazyKVVariant) and variant.layers_read == 0
    assert variant.num_tokens == 8 and variant.pending_bytes == variant.num_bytes
    k0, _ = variant.layers(slice(0, 1))
    assert torch.equal(k0, make_variant("a", num_tokens=8).k[:1])
    with pytest.raises(CorruptEntryError, match="layer 1"):
        variant.layers(slice(1, 2))
    with pytest.raises(CorruptEntryError):
        _ = variant.k  # never the unverified bytes
    assert store.metrics()["corrupt_dropped"] == 1
    assert store.variants(FP, "a") == [] and len(store.tiers[0]) == 0  # dropped, not promoted


def failing_read(monkeypatch: pytest.MonkeyPatch, bad_layer: int) -> None:
    """Every :class:`LayerFile` fails (``OSError``) to read layer ``bad_layer``."""
    read = LayerFile.read

    def failing(self: LayerFile, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer == bad_layer:
            raise OSError(5, "Input/output error")
        read(self, layer, k, v)

    monkeypatch.setattr(LayerFile, "read", failing)


def test_a_layer_the_disk_fails_to_read_is_an_io_error_not_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = TieredKVStore([MemoryTier("host", 10**6), DiskTier(tmp_path, 10**6)])
    TieredKVStore([DiskTier(tmp_path, 10**6)]).put(FP, make_variant("a", num_tokens=8))
    failing_read(monkeypatch, 1)
    (variant,) = store.variants(FP, "a")
    variant.layers(slice(0, 1))
    with pytest.raises(LayerReadError, match="layer 1 unreadable") as raised:
        variant.layers(slice(1, 2))
    assert isinstance(raised.value, CorruptEntryError)  # the engine reruns the request
    assert isinstance(raised.value.cause, OSError)
    with pytest.raises(LayerReadError):
        _ = variant.k  # never a half-read variant
    disk = store.metrics()["tiers"]["disk"]
    assert disk["errors"] == 1 and disk["corrupt_dropped"] == 0
    assert store.variants(FP, "a") == [] and len(store.tiers[0]) == 0  # dropped, not promoted


def test_an_io_error_mid_prefill_reruns_the_request_without_the_entry(
    lm: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_chunks(lm, tmp_path / "kv", "reuse")
    shutil.copytree(tmp_path / "kv", tmp_path / "copy")
    failing_read(monkeypatch, NUM_LAYERS - 2)  # a failing disk: every lazy read of layer 4
    store = host_and_disk(tmp_path / "kv")
    out = run(lm, store, "reuse", True)

    disk = out.stats.extra["store"]["tiers"]["disk"]
    assert disk["errors"] == 1 and "corrupt_dropped" not in disk
    assert store.metrics()["corrupt_dropped"] == 0
    # the first entry to fail was dropped; the rerun read the other whole (a lazy read of it
    # would have failed too)
    assert (out.stats.chunk_hits, out.stats.chunk_misses) == (1, 1)
    headers = (h for h in (tmp_path / "kv").rglob("*.json") if not h.name.startswith("."))
    (dropped,) = {"a", "b"} - {json.loads(h.read_text())["segment_id"] for h in headers}
    gone = data_file(tmp_path / "copy", dropped)
    gone.with_suffix(".json").unlink()
    gone.unlink()
    monkeypatch.undo()
    expected = run(lm, host_and_disk(tmp_path / "copy"), "reuse", False)
    assert torch.equal(out.logits, expected.logits)


def test_old_format_entries_are_misses_never_crashes(tmp_path: Path) -> None:
    variant = make_variant("a")
    disk_store = TieredKVStore([DiskTier(tmp_path, 10**6)])
    disk_store.put(FP, variant)
    old = tmp_path / "v1"
    shutil.copytree(tmp_path / LAYOUT, old)  # a format-1 directory left by an older version
    header = next(p for p in (tmp_path / LAYOUT).rglob("*.json") if not p.name.startswith("."))
    fields = json.loads(header.read_text())
    fields["format"] = 1  # an old-format entry inside the current layout
    header.write_text(json.dumps(fields))

    store = TieredKVStore([MemoryTier("host", 10**6), DiskTier(tmp_path, 10**6)])
    assert not old.exists()  # swept on open
    assert store.variants(FP, "a") == [] and store.exact(FP, "a", "root") is None
    assert store.metrics()["corrupt_dropped"] == 1 and not header.exists()
    # Redis blobs of another format are refused the same way
    data, fields = codec.encode(FP, variant)
    fields["format"] = 1
    with pytest.raises(CorruptEntryError, match="format"):
        codec.decode(data, fields, FP, codec.entry_key(FP, "a", "root"))

"""Faults in the middle of work: a layer, the store, a decode step, the consumer or the cache
bookkeeping raises, and the engine and its in-process backends must give the caller that error,
leave nothing half-written (store, conversation memory, reuse counts, batch slots), and serve
the next request exactly as a full prefill would (tiny random Llama, float32, seeded faults)."""

from __future__ import annotations

import gc
import queue
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import TIMEOUT_S, read_in_threads
from test_batching import collect
from tiny_models import TOLERANCE, chunk, random_ids, text, tiny_lm

from chunkcache.core import chunk_placing
from chunkcache.core import engine as engine_module
from chunkcache.core.batch_queue import Event
from chunkcache.core.batching import BatchingBackend
from chunkcache.core.engine import ChunkEngine, TokenSegment
from chunkcache.core.generation import GenerationRequest, Policy, SamplingParams
from chunkcache.core.kv_store import ROOT_CONTEXT, KVStore, MemoryKVStore, extend_context
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.segmenter import ChunkSegment, Segment, TextSegment
from chunkcache.core.store.codec import CorruptEntryError
from chunkcache.core.store.disk import DiskTier
from chunkcache.core.store.layer_file import LayerFile
from chunkcache.core.store.tier import MemoryTier
from chunkcache.core.store.tiered import TieredKVStore

SYSTEM = text(random_ids(9, 1))
A, B, C = (chunk(name, random_ids(17, seed)) for seed, name in enumerate("abc", start=2))
QUESTION, OTHER_QUESTION = text(random_ids(7, 9)), text(random_ids(6, 12))
HISTORY = ([SYSTEM, A, QUESTION], [SYSTEM, B, QUESTION])
REQUEST = [SYSTEM, B, A, C, OTHER_QUESTION]  # B and A moved, C new
SEEDS = (3, 11)


class Injected(RuntimeError):
    """The fault the tests raise."""


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_lm("llama")


@pytest.fixture(scope="module")
def full_request_logits(lm: LoadedModel) -> torch.Tensor:
    return ChunkEngine(lm).prefill(REQUEST, "full").logits


class Fault:
    """Raises ``error()`` on the ``at``-th call counted over every wrapped callable (None:
    never); thread-safe, so a scheduler or loader thread may make the call."""

    def __init__(self, error: Callable[[], BaseException] = lambda: Injected("injected")) -> None:
        self.error = error
        self.at: int | None = None
        self.calls = 0
        self.fired = False
        self._lock = threading.Lock()

    def wrap(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls += 1
                fire = self.calls == self.at
                self.fired |= fire
            if fire:
                raise self.error()
            return call(*args, **kwargs)

        return wrapped

    def arm(self, at: int | None) -> None:
        """Count calls from 0, raising on the ``at``-th (None: counting only)."""
        with self._lock:
            self.at, self.calls, self.fired = at, 0, False

    def disarm(self) -> None:
        """Raise no more (``fired`` still tells whether it did)."""
        with self._lock:
            self.at = None


@contextmanager
def layer_faults(lm: LoadedModel, part: str, fault: Fault) -> Iterator[Fault]:
    """``fault`` wraps every decoder layer's ``part``: ``input_layernorm`` fails a layer before
    it writes any K/V, ``mlp`` after its attention wrote the rows' K/V."""
    modules = [getattr(layer, part) for layer in lm.decoder.layers]
    for module in modules:
        module.forward = fault.wrap(module.forward)
    try:
        yield fault
    finally:
        for module in modules:
            del module.forward  # the class's forward again


def picks(total: int, seed: int) -> list[int]:
    """The first call, the last, and a seeded one between: first layer, last layer, a middle."""
    return sorted({1, total, random.Random(seed).randint(1, total)})


def history_engine(lm: LoadedModel, store: KVStore | None = None, **options: Any) -> ChunkEngine:
    engine = ChunkEngine(lm, store, **options)
    for segments in HISTORY:
        engine.prefill(segments, "full")
    return engine


def store_snapshot(store: MemoryKVStore) -> dict[tuple[str, str, str], tuple[bool, bytes, int]]:
    """Every entry's exactness, K/V bytes and reuse count."""
    return {
        key: (v.exact, v.k.numpy().tobytes() + v.v.numpy().tobytes(), v.reuse.num_reuses)
        for key, v in store._entries.items()
    }


def assert_store_accounts(store: MemoryKVStore) -> None:
    assert store.num_bytes == sum(v.num_bytes for v in store._entries.values())
    by_segment = {(fp, seg) for fp, seg, _ in store._entries}
    assert by_segment == set(store._by_segment)


def assert_exact_variants_are_full_prefill(
    lm: LoadedModel, store: KVStore, segments: Sequence[TokenSegment]
) -> None:
    """Every exact variant stored for ``segments``' contexts holds a full prefill's K/V."""
    kv = ChunkEngine(lm).prefill(segments, "full").kv
    start, context = 0, ROOT_CONTEXT
    for segment in segments:
        end = start + len(segment.ids)
        variant = store.exact(lm.fingerprint, segment.segment_id, context)
        if variant is not None:
            assert (variant.k - kv.k[:, :, start:end]).abs().max().item() < TOLERANCE
            assert (variant.v - kv.v[:, :, start:end]).abs().max().item() < TOLERANCE
        start, context = end, extend_context(context, segment.segment_id)


def assert_serves_exactly(engine: ChunkEngine, expected: torch.Tensor) -> None:
    """The request again: a full prefill's logits, with both moved chunks taken from the store."""
    out = engine.prefill(REQUEST, "cacheblend", ratio=1.0)
    assert (out.logits - expected).abs().max().item() < TOLERANCE
    assert out.stats.chunk_hits >= 2


# -- prefill -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "ratio"),
    [
        ("full", 0.0),
        ("prefix", 0.0),
        ("reuse", 0.0),
        ("cacheblend", 0.3),
        ("cacheblend", 1.0),
        ("cachecraft", 0.3),
    ],
)
@pytest.mark.parametrize("part", ["input_layernorm", "mlp"])
def test_a_layer_failing_mid_prefill_leaves_nothing_and_the_next_request_is_exact(
    lm: LoadedModel, full_request_logits: torch.Tensor, policy: Policy, ratio: float, part: str
) -> None:
    """First layer, last layer, a seeded one between; in a selective recompute the layers
    before it already wrote recomputed K/V into the request's KV."""
    with layer_faults(lm, part, Fault()) as fault:
        counting = history_engine(lm)
        fault.arm(None)
        counting.prefill(REQUEST, policy, ratio)
        total = fault.calls
        for at in picks(total, seed=SEEDS[0]):
            engine = history_engine(lm)
            store = engine.store
            assert isinstance(store, MemoryKVStore)
            before = store_snapshot(store)
            fault.arm(at)
            with pytest.raises(Injected):
                engine.prefill(REQUEST, policy, ratio, conversation_id="c")
            fault.disarm()
            assert store_snapshot(store) == before  # nothing stored, no reuse counted
            assert_store_accounts(store)
            assert engine.remembered() == {}
            assert_serves_exactly(engine, full_request_logits)


def test_a_cachecraft_prefill_counts_its_reuses_once_it_ran(lm: LoadedModel) -> None:
    """Cache-Craft's f_r drives eviction: a prefill that failed reused nothing, and one run
    again after a corrupt entry reused each variant once (it was counted per attempt)."""
    engine = history_engine(lm)
    (variant,) = engine.store.variants(lm.fingerprint, A.segment_id)  # placed (B: the prefix)
    with layer_faults(lm, "mlp", Fault()) as fault:
        fault.arm(2)
        with pytest.raises(Injected):
            engine.prefill(REQUEST, "cachecraft", 0.3)
        assert variant.reuse.num_reuses == 0
        fault.error = lambda: CorruptEntryError("a layer failed its checksum")
        fault.arm(2)
        engine.prefill(REQUEST, "cachecraft", 0.3)  # runs again
        assert fault.fired
    assert variant.reuse.num_reuses == 1


@pytest.mark.parametrize("seed", SEEDS)
def test_a_layer_loader_or_compute_failing_with_layer_loading_ends_the_request(
    lm: LoadedModel,
    full_request_logits: torch.Tensor,
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
) -> None:
    """Placing on the background loader thread: its failure reaches the caller, a compute
    failure stops it, no thread is left waiting, and nothing is stored."""
    placer = Fault()
    monkeypatch.setattr(chunk_placing, "place_layers", placer.wrap(chunk_placing.place_layers))
    layers = lm.spec.num_layers
    rng = random.Random(seed)
    with layer_faults(lm, "input_layernorm", Fault()) as compute:
        for fault in (placer, compute):
            engine = history_engine(lm, layer_loading=True)
            assert isinstance(engine.store, MemoryKVStore)
            before = store_snapshot(engine.store)
            threads = set(threading.enumerate())  # other tests' threads may end meanwhile
            fault.arm(rng.randint(1, layers))
            with pytest.raises(Injected):
                engine.prefill(REQUEST, "cacheblend", 0.3)
            fault.disarm()
            assert not [t for t in threading.enumerate() if t not in threads]
            assert store_snapshot(engine.store) == before
            assert_serves_exactly(engine, full_request_logits)


# -- the store -----------------------------------------------------------------------------


class FlakyStore(MemoryKVStore):
    """A memory store whose put, exact and variants go through ``fault``."""

    def __init__(self, fault: Fault) -> None:
        super().__init__()
        self.put = fault.wrap(super().put)  # type: ignore[method-assign]
        self.exact = fault.wrap(super().exact)  # type: ignore[method-assign]
        self.variants = fault.wrap(super().variants)  # type: ignore[method-assign]


@pytest.mark.parametrize("policy", ["prefix", "cacheblend", "cachecraft"])
def test_a_store_call_failing_leaves_only_whole_exact_variants(
    lm: LoadedModel, full_request_logits: torch.Tensor, policy: Policy
) -> None:
    """Every store call of the request in turn raises MemoryError: the caller gets it, what
    was stored before it is whole, and the next request is exact."""
    fault = Fault(lambda: MemoryError("the store ran out of memory"))
    store = FlakyStore(fault)
    history_engine(lm, store)
    fault.arm(None)
    ChunkEngine(lm, store).prefill(REQUEST, policy, 0.3)
    total = fault.calls
    for at in range(1, total + 1):
        store = FlakyStore(fault)
        engine = history_engine(lm, store)
        fault.arm(at)
        with pytest.raises(MemoryError):
            engine.prefill(REQUEST, policy, 0.3, conversation_id="c")
        fault.disarm()
        assert_store_accounts(store)
        for segments in (*HISTORY, REQUEST):
            assert_exact_variants_are_full_prefill(lm, store, segments)
        assert engine.remembered() == {}
        assert_serves_exactly(engine, full_request_logits)


def tiered_store(root: Path) -> TieredKVStore:
    """A host tier that holds about one chunk's variant over a disk tier: most hits are read
    from disk, lazily, layer by layer."""
    return TieredKVStore([MemoryTier("host", 12_000), DiskTier(root, 10**8)])


@pytest.mark.parametrize(
    ("where", "error"),
    [
        ("host.put", Injected),
        ("host.get", Injected),
        ("disk.put", OSError),
        ("disk.get", OSError),
        ("disk.get", Injected),
        ("layer_read", OSError),
        ("layer_read", Injected),
    ],
)
def test_a_failing_tier_is_a_miss_or_the_callers_error_never_wrong_kv(
    lm: LoadedModel,
    full_request_logits: torch.Tensor,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    where: str,
    error: type[BaseException],
) -> None:
    """A disk failing with OSError is a miss (a layer read failing mid-prefill runs the
    request again); any other error is the caller's; either way the next requests are exact
    and reuse every chunk once it is stored again."""
    fault = Fault(lambda: error("injected"))

    def wire(store: TieredKVStore) -> None:
        host, disk = store.tiers
        targets: dict[str, tuple[Any, list[str]]] = {
            "host.put": (host, ["put"]),
            "host.get": (host, ["get"]),
            "disk.put": (disk, ["put", "prepare"]),
            "disk.get": (disk, ["get", "open_lazy"]),
        }
        if where in targets:
            owner, names = targets[where]
            for name in names:
                setattr(owner, name, fault.wrap(getattr(owner, name)))

    if where == "layer_read":
        monkeypatch.setattr(LayerFile, "read", fault.wrap(LayerFile.read))
    store = tiered_store(tmp_path / "count")
    wire(store)
    counting = history_engine(lm, store)
    fault.arm(None)
    counting.prefill(REQUEST, "cacheblend", 0.3)
    total = fault.calls
    assert total > 0
    for at in range(1, total + 1):
        store = tiered_store(tmp_path / str(at))
        wire(store)
        engine = history_engine(lm, store)
        fault.arm(at)
        try:
            engine.prefill(REQUEST, "cacheblend", 0.3)
        except error:
            assert error is not OSError  # a failing disk never fails a request
        fault.disarm()
        assert fault.fired
        for segments in (*HISTORY, REQUEST):
            assert_exact_variants_are_full_prefill(lm, store, segments)
        engine.prefill(REQUEST, "cacheblend", ratio=1.0)  # stores what the fault lost
        out = engine.prefill(REQUEST, "cacheblend", ratio=1.0)
        assert (out.logits - full_request_logits).abs().max().item() < TOLERANCE
        assert (out.stats.chunk_hits, out.stats.chunk_misses) == (3, 0)


# -- decoding and the local backend --------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_a_decode_step_failing_keeps_the_tokens_before_it_and_a_consistent_sequence(
    lm: LoadedModel, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """The caller gets the error after the tokens an unfaulted decode gives, and the KV and
    the ids stay in step: the failed step's slot is not counted."""
    params = SamplingParams(max_tokens=12)
    engine = history_engine(lm)
    expected = list(engine.decode(engine.prefill(REQUEST, "prefix"), params))
    fault = Fault()
    monkeypatch.setattr(engine_module, "decode_step", fault.wrap(engine_module.decode_step))
    fault.arm(random.Random(seed).randint(1, 10))
    prefilled = engine.prefill(REQUEST, "prefix")
    tokens: list[int] = []
    with pytest.raises(Injected):
        tokens.extend(engine.decode(prefilled, params))
    assert tokens == expected[: len(tokens)] and 0 < len(tokens) < len(expected)
    prompt_tokens = sum(len(segment.ids) for segment in REQUEST)
    assert prefilled.kv.length == len(prefilled.ids) == prompt_tokens + len(tokens) - 1


def words(start: int, n: int) -> str:
    return " ".join(f"w{(start + i * 7) % 120}" for i in range(n))


def turn(answer: str = "", policy: Policy = "prefix", max_tokens: int = 10) -> GenerationRequest:
    """A conversation's turn: the first one, or the second with the first's answer."""
    segments: list[Segment] = [
        TextSegment(words(1, 6) + " "),
        ChunkSegment("doc", words(20, 18)),
        TextSegment(" " + words(5, 4) + (" " + words(60, 3) + answer if answer else "")),
    ]
    sampling = SamplingParams(max_tokens=max_tokens)
    return GenerationRequest(segments, conversation_id="c", policy=policy, sampling=sampling)


def memory_of(engine: ChunkEngine) -> list[tuple[tuple[int, ...], int]]:
    return [(past.ids, past.exact_until) for past in engine.conversations.pasts()]


def assert_next_turn_exact(lm: LoadedModel, backend: LocalBackend, request: Any) -> None:
    """The turn again, from the conversation's past: a full prefill's logits and text."""
    segments = backend.segment_tokenizer(request.segments)
    out = backend.engine.prefill(segments, "prefix", conversation_id="c")
    full = ChunkEngine(lm).prefill(segments, "full")
    assert (out.logits - full.logits).abs().max().item() < TOLERANCE
    assert out.stats.reused_tokens > len(segments[0].ids)  # past the system text: the past's
    alone = LocalBackend(ChunkEngine(lm)).stream(request)
    assert collect(backend.stream(request))[0] == collect(alone)[0]


FAULTS = ["decode_error", "decode_interrupt", "prefill_interrupt", "remember", "close", "drop"]


@pytest.mark.parametrize("kind", FAULTS)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_local_turn_that_fails_or_stops_is_not_remembered_and_frees_the_engine(
    lm: LoadedModel, monkeypatch: pytest.MonkeyPatch, kind: str, seed: int
) -> None:
    """A turn whose decode raises (an error, or Ctrl-C: KeyboardInterrupt), whose prefill is
    interrupted, whose KV cannot be copied out to be remembered (MemoryError), or whose
    stream is closed or dropped after a seeded number of pieces."""
    engine = ChunkEngine(lm)
    backend = LocalBackend(engine)
    first, _ = collect(backend.stream(turn()))
    kept = memory_of(engine)
    second = turn(first)
    step = random.Random(seed).randint(1, 6)
    fault = Fault(KeyboardInterrupt if kind.endswith("interrupt") else Injected)
    fault.arm(step)
    if kind.startswith("decode"):
        monkeypatch.setattr(engine_module, "decode_step", fault.wrap(engine_module.decode_step))
    if kind == "remember":
        fault = Fault(lambda: MemoryError("no room to copy the KV"))
        fault.arm(1)
        monkeypatch.setattr(engine_module, "_trimmed", fault.wrap(engine_module._trimmed))
    stream = backend.stream(second)
    with layer_faults(lm, "mlp", fault if kind == "prefill_interrupt" else Fault()):
        if kind in ("close", "drop"):
            for i, _piece in enumerate(stream):
                if i + 1 == step:
                    break
            if kind == "close":
                stream.close()
            else:
                del stream
                gc.collect()
        else:
            with pytest.raises((Injected, KeyboardInterrupt, MemoryError)):
                list(stream)
    monkeypatch.undo()
    assert not backend._lock.locked()
    assert memory_of(engine) == kept
    assert_next_turn_exact(lm, backend, second)


# -- the batching backend ------------------------------------------------------------------


def in_flight_adds_up(metrics: dict[str, float]) -> bool:
    ended = metrics["finished_total"] + metrics["failed_total"] + metrics["cancelled_total"]
    return metrics["requests_total"] == ended and metrics["running"] == metrics["waiting"] == 0


@pytest.mark.parametrize("max_tokens", [1, 6])
def test_a_batched_turn_failing_to_be_remembered_fails_alone_and_the_scheduler_lives_on(
    lm: LoadedModel, monkeypatch: pytest.MonkeyPatch, max_tokens: int
) -> None:
    """Remembering a finished turn copies its KV out; a MemoryError there raised on the
    scheduler thread and killed it: every later request failed with BackendUnavailableError.
    One token ends the request in its prefill, more in a decode step."""
    engine = ChunkEngine(lm)
    backend = BatchingBackend(engine, max_batch=2)
    fault = Fault(lambda: MemoryError("no room to copy the KV"))
    monkeypatch.setattr(engine_module, "_trimmed", fault.wrap(engine_module._trimmed))
    try:
        fault.arm(1)
        with pytest.raises(MemoryError):
            collect(backend.submit(turn(max_tokens=max_tokens)))
        assert engine.remembered() == {}
        first, _ = collect(backend.submit(turn(max_tokens=max_tokens)))
        assert backend.metrics()["failed_total"] == 1 and in_flight_adds_up(backend.metrics())
        local = LocalBackend(ChunkEngine(lm))
        assert first == collect(local.stream(turn(max_tokens=max_tokens)))[0]
        second, stats = collect(backend.submit(turn(first)))
        assert stats.reused_tokens > 0
        assert second == collect(local.stream(turn(first)))[0]
    finally:
        assert backend.shutdown(timeout_s=TIMEOUT_S)


def batch_request(i: int) -> GenerationRequest:
    segments: list[Segment] = [
        TextSegment(words(1, 6) + " "),
        ChunkSegment(f"doc{i % 3}", words(20 + i % 3 * 5, 15)),
        TextSegment(" " + words(40 + i, 3)),
    ]
    conversation = f"c{i % 2}" if i % 3 else None
    sampling = SamplingParams(max_tokens=3 + i % 5)
    return GenerationRequest(segments, conversation, "prefix", sampling=sampling)


@pytest.mark.parametrize("part", ["input_layernorm", "mlp"])
@pytest.mark.parametrize("seed", SEEDS)
def test_a_layer_failing_in_a_batch_fails_at_most_its_request_and_the_rest_are_exact(
    lm: LoadedModel, part: str, seed: int
) -> None:
    """A seeded call of the batch's compute raises: in a prefill it fails that request, in a
    batched decode step each request steps again alone. Every request ends, the others get
    the text they get alone, the counters add up, and the engine then serves exactly."""
    requests = [batch_request(i) for i in range(6)]
    expected = [collect(LocalBackend(ChunkEngine(lm)).stream(r))[0] for r in requests]
    engine = ChunkEngine(lm)
    backend = BatchingBackend(engine, max_batch=3)
    with layer_faults(lm, part, Fault()) as fault:
        # 6 prefills and at least 6 decode steps, 3 layers each: >= 36 calls
        fault.arm(random.Random(seed).randint(1, 36))
        try:
            results = read_in_threads([backend.submit(r) for r in requests])
        finally:
            fault.disarm()
        assert fault.fired
    try:
        failed = [r for r in results if isinstance(r, BaseException)]
        assert all(isinstance(r, Injected) for r in failed) and len(failed) <= 1
        for result, want in zip(results, expected, strict=True):
            if not isinstance(result, BaseException):
                assert result[0] == want
        metrics = backend.metrics()
        assert in_flight_adds_up(metrics) and metrics["failed_total"] == len(failed)
        segments = backend.segment_tokenizer(requests[1].segments)
        out = engine.prefill(segments, "prefix", conversation_id="c1")
        full = ChunkEngine(lm).prefill(segments, "full")
        assert (out.logits - full.logits).abs().max().item() < TOLERANCE
        assert out.stats.reused_tokens > 0
    finally:
        assert backend.shutdown(timeout_s=TIMEOUT_S)


class InterruptedOnce(queue.SimpleQueue[Event]):
    """A job's event queue whose first wait is interrupted by Ctrl-C."""

    interrupted = False

    def get(self, block: bool = True, timeout: float | None = None) -> Event:
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return super().get(block, timeout)


def test_a_consumer_interrupted_while_waiting_frees_its_slot_once_it_lets_go(
    lm: LoadedModel,
) -> None:
    """Ctrl-C while a batched stream waits for its next piece: the consumer gets the
    KeyboardInterrupt; once it drops the handle (and the error) the request is cancelled."""
    backend = BatchingBackend(ChunkEngine(lm), max_batch=1)
    try:
        request = batch_request(1)
        long = GenerationRequest(
            request.segments, None, "prefix", sampling=SamplingParams(max_tokens=400)
        )
        handle = backend.submit(long)
        next(handle)
        handle._job.events = InterruptedOnce()  # the pieces still to come go there
        with pytest.raises(KeyboardInterrupt):
            next(handle)
        del handle
        gc.collect()
        text, _ = collect(backend.submit(request))  # its slot is free: it runs
        assert text == collect(LocalBackend(ChunkEngine(lm)).stream(request))[0]
        metrics = backend.metrics()
        assert metrics["cancelled_total"] == 1 and in_flight_adds_up(metrics)
    finally:
        assert backend.shutdown(timeout_s=TIMEOUT_S)

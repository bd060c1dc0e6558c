"""CRAFT's per-conversation ChunkMap: drop / mark / off, bounds, expiry, threads."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TypedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from chunkcache.core.errors import InvalidConversationIdError
from chunkcache.core.ledger import (
    DEDUPE_MODES,
    MAX_CONVERSATION_ID_LENGTH,
    ConversationLedger,
    DedupeMode,
    check_conversation_id,
    check_dedupe_mode,
)


class LedgerBounds(TypedDict, total=False):
    max_conversations: int
    ttl_s: float
    max_chunks_per_conversation: int


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_modes() -> None:
    assert set(DEDUPE_MODES) == {"drop", "mark", "off"}
    for mode in DEDUPE_MODES:
        assert check_dedupe_mode(mode) == mode
    with pytest.raises(ValueError):
        check_dedupe_mode("dedupe")
    with pytest.raises(ValueError):
        ConversationLedger().apply("c", ["a"], "Drop")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{"max_conversations": 0}, {"ttl_s": 0}, {"ttl_s": -1.0}, {"max_chunks_per_conversation": 0}],
)
def test_bounds_must_be_positive(kwargs: LedgerBounds) -> None:
    with pytest.raises(ValueError):
        ConversationLedger(**kwargs)


def test_drop_leaves_out_chunks_of_earlier_turns() -> None:
    # CRAFT §4.3: turn 1 retrieves [C1, C2, C3], turn 2 [C2, C3, C4]: only C4 is new.
    ledger = ConversationLedger()
    first = ledger.apply("conv", ["C1", "C2", "C3"], "drop")
    assert first.kept == ["C1", "C2", "C3"]
    assert first.dropped == []
    assert first.seen == frozenset()
    second = ledger.apply("conv", ["C2", "C3", "C4"], "drop")
    assert second.kept == ["C4"]
    assert second.dropped == ["C2", "C3"]
    assert second.seen == {"C1", "C2", "C3"}
    assert ledger.seen("conv") == {"C1", "C2", "C3", "C4"}
    # A turn with nothing new keeps nothing.
    third = ledger.apply("conv", ["C4", "C1"], "drop")
    assert third.kept == []
    assert third.dropped == ["C4", "C1"]


def test_replace_makes_the_given_ids_the_whole_set() -> None:
    ledger = ConversationLedger()
    ledger.apply("conv", ["C1", "C2"], "drop")
    ledger.replace("conv", ["C2", "C3"])
    assert ledger.seen("conv") == {"C2", "C3"}
    ledger.replace("new", [])
    assert "new" in ledger and ledger.seen("new") == frozenset()


def test_drop_is_scoped_to_one_conversation() -> None:
    ledger = ConversationLedger()
    ledger.apply("alice", ["C1", "C2"], "drop")
    other = ledger.apply("bob", ["C1", "C2"], "drop")
    assert other.kept == ["C1", "C2"]
    assert other.dropped == []
    assert other.seen == frozenset()


def test_mark_keeps_everything_and_reports_what_was_seen() -> None:
    ledger = ConversationLedger()
    ledger.apply("conv", ["C1", "C2"], "mark")
    result = ledger.apply("conv", ["C2", "C3"], "mark")
    assert result.kept == ["C2", "C3"]
    assert result.dropped == []
    assert result.seen == {"C1", "C2"}
    assert ledger.seen("conv") == {"C1", "C2", "C3"}


def test_off_keeps_everything_and_records_nothing() -> None:
    ledger = ConversationLedger()
    result = ledger.apply("conv", ["C1", "C2"], "off")
    assert result.kept == ["C1", "C2"]
    assert result.dropped == []
    assert "conv" not in ledger
    assert ledger.seen("conv") == frozenset()
    ledger.apply("conv", ["C1"], "mark")
    result = ledger.apply("conv", ["C1", "C9"], "off")
    assert result.kept == ["C1", "C9"]
    assert result.seen == {"C1"}  # still reported, never acted on
    assert ledger.seen("conv") == {"C1"}


@pytest.mark.parametrize("mode", DEDUPE_MODES)
def test_duplicates_within_one_turn_collapse_in_order(mode: DedupeMode) -> None:
    result = ConversationLedger().apply("conv", ["b", "a", "b", "a", "c"], mode)
    assert result.kept == ["b", "a", "c"]
    assert result.dropped == []


def test_unknown_conversation_starts_a_new_one() -> None:
    ledger = ConversationLedger()
    assert "fresh" not in ledger
    assert ledger.seen("fresh") == frozenset()
    result = ledger.apply("fresh", ["a"], "drop")
    assert result.kept == ["a"]
    assert result.seen == frozenset()
    assert "fresh" in ledger
    assert len(ledger) == 1


def test_record_and_forget() -> None:
    ledger = ConversationLedger()
    ledger.record("conv", ["a", "b"])
    assert ledger.apply("conv", ["a", "c"], "drop").kept == ["c"]
    assert ledger.forget("conv") is True
    assert ledger.forget("conv") is False
    assert ledger.apply("conv", ["a"], "drop").kept == ["a"]


def test_int_ids_are_the_same_conversation_as_their_str() -> None:
    ledger = ConversationLedger()
    ledger.apply(42, ["a"], "mark")  # type: ignore[arg-type]  # int ids are accepted at run time
    assert ledger.seen("42") == {"a"}
    assert 42 in ledger
    assert "42" in ledger


@pytest.mark.parametrize(
    "bad",
    ["", "x" * (MAX_CONVERSATION_ID_LENGTH + 1), None, True, False, [], ["a"], 1.5, b"id", {}],
)
def test_invalid_conversation_ids_raise(bad: object) -> None:
    ledger = ConversationLedger()
    with pytest.raises(InvalidConversationIdError):
        check_conversation_id(bad)
    with pytest.raises(InvalidConversationIdError):
        ledger.apply(bad, ["a"], "drop")  # type: ignore[arg-type]
    with pytest.raises(InvalidConversationIdError):
        ledger.seen(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidConversationIdError):
        ledger.record(bad, ["a"])  # type: ignore[arg-type]
    with pytest.raises(InvalidConversationIdError):
        ledger.forget(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # also a ValueError for callers that catch those
        ledger.apply(bad, ["a"], "mark")  # type: ignore[arg-type]
    assert (bad in ledger) is False
    assert len(ledger) == 0


def test_longest_valid_conversation_id() -> None:
    key = "x" * MAX_CONVERSATION_ID_LENGTH
    ledger = ConversationLedger()
    ledger.apply(key, ["a"], "mark")
    assert ledger.seen(key) == {"a"}


def test_ttl_expiry_with_an_injected_clock() -> None:
    clock = FakeClock()
    ledger = ConversationLedger(ttl_s=10.0, clock=clock)
    ledger.apply("old", ["a"], "drop")
    clock.now = 5.0
    ledger.apply("young", ["b"], "drop")
    clock.now = 10.0  # exactly ttl after "old": still kept
    assert ledger.seen("old") == {"a"}
    clock.now = 10.5
    assert "old" not in ledger
    assert ledger.seen("old") == frozenset()
    assert "young" in ledger
    # An expired id starts afresh: its chunks are new again.
    assert ledger.apply("old", ["a"], "drop").kept == ["a"]
    clock.now = 15.5
    assert ledger.seen("young") == frozenset()
    assert len(ledger) == 1


def test_use_refreshes_the_ttl_but_reading_does_not() -> None:
    clock = FakeClock()
    ledger = ConversationLedger(ttl_s=10.0, clock=clock)
    ledger.apply("c", ["a"], "mark")
    clock.now = 8.0
    ledger.apply("c", ["b"], "drop")  # a turn: refreshes
    clock.now = 16.0
    assert ledger.seen("c") == {"a", "b"}  # a read: does not refresh
    clock.now = 18.5
    assert "c" not in ledger


def test_lru_bound_over_conversations() -> None:
    ledger = ConversationLedger(max_conversations=2)
    ledger.apply("a", ["1"], "mark")
    ledger.apply("b", ["2"], "mark")
    ledger.apply("a", ["3"], "mark")  # a is now the most recent
    ledger.apply("c", ["4"], "mark")  # evicts b
    assert len(ledger) == 2
    assert "b" not in ledger
    assert ledger.seen("a") == {"1", "3"}
    assert ledger.seen("c") == {"4"}
    assert ledger.apply("b", ["2"], "drop").kept == ["2"]  # b starts afresh, evicts a
    assert "a" not in ledger


def test_per_conversation_chunk_bound_drops_the_oldest_ids() -> None:
    ledger = ConversationLedger(max_chunks_per_conversation=3)
    ledger.apply("c", ["a", "b"], "mark")
    ledger.apply("c", ["c", "d", "e"], "mark")
    assert ledger.seen("c") == {"c", "d", "e"}
    # A forgotten id counts as new again (safe: it is only recomputed).
    assert ledger.apply("c", ["a", "e"], "drop").kept == ["a"]
    assert ledger.seen("c") == {"d", "e", "a"}


def test_a_turn_larger_than_the_bound_keeps_everything_and_records_the_last() -> None:
    ledger = ConversationLedger(max_chunks_per_conversation=2)
    result = ledger.apply("c", ["a", "b", "c", "d"], "drop")
    assert result.kept == ["a", "b", "c", "d"]
    assert ledger.seen("c") == {"c", "d"}


def test_an_id_put_in_a_prompt_again_is_recent_again() -> None:
    """The bound evicts the ids a prompt carried longest ago: an id just marked again is
    in this turn's prompt, so an older one goes first."""
    ledger = ConversationLedger(max_chunks_per_conversation=2)
    ledger.apply("c", ["a", "b"], "mark")
    ledger.apply("c", ["a"], "mark")
    ledger.apply("c", ["c"], "mark")
    assert ledger.seen("c") == {"a", "c"}
    ledger.replace("r", ["x", "y", "x"])  # a history that repeats x: its last copy counts
    ledger.record("r", ["z"])
    assert ledger.seen("r") == {"x", "z"}


@pytest.mark.parametrize("method", ["apply", "record", "replace"])
def test_one_bare_str_of_ids_is_refused(method: str) -> None:
    ledger = ConversationLedger()
    args: tuple[object, ...] = ("c", "abc", "drop") if method == "apply" else ("c", "abc")
    with pytest.raises(TypeError, match="not one str"):
        getattr(ledger, method)(*args)
    assert "c" not in ledger


def test_many_threads_lose_no_ids() -> None:
    ledger = ConversationLedger()
    num_threads, per_thread = 8, 200
    barrier = threading.Barrier(num_threads)

    def work(t: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            ledger.apply("shared", [f"t{t}-{i}", "common"], "mark")
            ledger.apply(f"own-{t}", [f"x{i}"], "drop")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected = {f"t{t}-{i}" for t in range(num_threads) for i in range(per_thread)}
    assert ledger.seen("shared") == expected | {"common"}
    for t in range(num_threads):
        assert ledger.seen(f"own-{t}") == {f"x{i}" for i in range(per_thread)}
    assert len(ledger) == num_threads + 1


def test_concurrent_drop_keeps_each_id_exactly_once() -> None:
    # apply is atomic: of many threads offering the same ids, exactly one keeps each.
    ledger = ConversationLedger()
    ids = [f"c{i}" for i in range(300)]
    kept: list[list[str]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(6)

    def work(offset: int) -> None:
        barrier.wait()
        mine: list[str] = []
        for start in range(0, len(ids), 10):
            batch = ids[(start + offset * 7) % len(ids) :][:10]
            mine.extend(ledger.apply("conv", batch, "drop").kept)
        mine.extend(ledger.apply("conv", ids, "drop").kept)
        with lock:
            kept.append(mine)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    everything = [cid for mine in kept for cid in mine]
    assert sorted(everything) == sorted(ids)


class LedgerMachine(RuleBasedStateMachine):
    """Random operations against a plain model of the ledger's documented bounds."""

    MAX_CONVERSATIONS = 3
    MAX_CHUNKS = 4
    TTL = 10.0

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.ledger = ConversationLedger(
            max_conversations=self.MAX_CONVERSATIONS,
            ttl_s=self.TTL,
            max_chunks_per_conversation=self.MAX_CHUNKS,
            clock=self.clock,
        )
        # conversation -> (ids oldest first, last used); dict order is LRU order.
        self.model: OrderedDict[str, tuple[list[str], float]] = OrderedDict()

    def _expire(self) -> None:
        for key, (_, last_used) in list(self.model.items()):
            if self.clock.now - last_used > self.TTL:
                del self.model[key]

    @rule(
        conversation=st.sampled_from("abcde"),
        ids=st.lists(st.sampled_from("pqrstuvw"), max_size=6),
        mode=st.sampled_from(DEDUPE_MODES),
    )
    def apply(self, conversation: str, ids: list[str], mode: DedupeMode) -> None:
        self._expire()
        before, _ = self.model.get(conversation, ([], 0.0))
        unique = list(dict.fromkeys(ids))
        result = self.ledger.apply(conversation, ids, mode)
        assert result.seen == set(before)
        expected_kept = [c for c in unique if c not in before] if mode == "drop" else unique
        assert result.kept == expected_kept
        assert result.dropped == [c for c in unique if c not in expected_kept]
        if mode == "off":
            return
        recorded = [cid for cid in before if cid not in expected_kept] + expected_kept
        self.model.pop(conversation, None)
        self.model[conversation] = (recorded[-self.MAX_CHUNKS :], self.clock.now)
        while len(self.model) > self.MAX_CONVERSATIONS:
            self.model.popitem(last=False)

    @rule(conversation=st.sampled_from("abcde"))
    def forget(self, conversation: str) -> None:
        existed = self.ledger.forget(conversation)
        self._expire()
        assert existed == (self.model.pop(conversation, None) is not None)

    @rule(seconds=st.sampled_from([0.0, 1.0, 4.0, 10.0, 11.0]))
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds

    @invariant()
    def matches_the_model(self) -> None:
        self._expire()
        assert len(self.ledger) == len(self.model) <= self.MAX_CONVERSATIONS
        for conversation in "abcde":
            ids, _ = self.model.get(conversation, ([], 0.0))
            seen = self.ledger.seen(conversation)
            assert seen == set(ids)
            assert len(seen) <= self.MAX_CHUNKS


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)

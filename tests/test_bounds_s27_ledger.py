"""The conversation ledger ``ChunkCache`` builds stays small in the worst case.

It keeps ``2 x window`` conversations; at 10,000 ids each the default could hold 20
million ids (~2 GB).  A conversation now keeps its 2,000 most recent ids, twice what
100 turns of 10 chunks need.
"""

from __future__ import annotations

import gc
import tracemalloc

from chunkcache.core import ChunkCache
from chunkcache.core.ledger import ConversationLedger

PER_ID_BYTES = 150  # a 32-hex-char id and its dict slot: ~100 B measured, with room


def ids(turn: int, k: int = 10) -> list[str]:
    return [f"{turn:08x}{i:024x}" for i in range(k)]


def test_a_conversation_of_the_default_cache_keeps_its_last_2000_ids() -> None:
    cache = ChunkCache()
    for turn in range(500):  # 5,000 distinct chunks in one conversation
        cache.arrange(ids(turn), conversation_id="long", dedupe="drop")
    seen = cache.ledger.seen("long")
    assert seen == {cid for turn in range(300, 500) for cid in ids(turn)}
    assert cache.arrange(ids(0), conversation_id="long", dedupe="drop").dropped == []
    assert cache.arrange(ids(499), conversation_id="long", dedupe="drop").order == []


def test_the_default_cache_ledger_worst_case_is_four_million_ids() -> None:
    ledger = ChunkCache().ledger
    assert ledger.max_conversations * ledger.max_chunks_per_conversation <= 4_000_000


def test_full_conversations_retain_what_the_bound_allows() -> None:
    ledger = ConversationLedger()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for conversation in range(20):
            for turn in range(500):  # 5,000 distinct ids each
                ledger.record(f"conv-{conversation}", ids(turn))
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert retained < 20 * 2000 * PER_ID_BYTES
    assert all(len(ledger.seen(f"conv-{c}")) == 2000 for c in range(20))

"""The main job: a multi-turn RAG session over the bundled corpus, retriever side.

Builds a Chroma index of the bundled corpus (Python standard-library docs,
MiniLM embeddings), wraps its retriever in ``ChunkCacheRetriever`` and replays
a stream of multi-turn conversations.  For a few conversations it prints, per
turn, the chunks in the order chunkcache chose (with the retriever's rank), what
was dropped as already in the conversation, and how much of the chunk list is
prefix-aligned with an earlier request (what a prefix cache can reuse).

    python cookbook/rag_chat.py [--warmup 150] [--show 3] [--seed 0]
"""

from __future__ import annotations

import argparse
from typing import Any

from chunkcache.core import ChunkCache, prefix_metric, total_metric
from chunkcache.core.chunk_ids import chunk_id_for
from chunkcache.core.corpus import load_corpus
from chunkcache.core.metrics import PrefixTracker
from chunkcache.core.workload import Turn, WorkloadConfig, multi_turn_trace
from chunkcache.integrations.indexes import langchain_corpus_retriever
from chunkcache.integrations.langchain import ChunkCacheRetriever


def conversations(turns: list[Turn]) -> dict[str, list[Turn]]:
    grouped: dict[str, list[Turn]] = {}
    for turn in turns:
        grouped.setdefault(turn.conversation_id, []).append(turn)
    return grouped


def main() -> None:
    parser = argparse.ArgumentParser(description="Multi-turn RAG session, retriever side.")
    parser.add_argument("--warmup", type=int, default=150, help="conversations replayed first")
    parser.add_argument("--show", type=int, default=3, help="conversations printed turn by turn")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print("Loading the bundled corpus and its Chroma index (built once, then cached)...")
    corpus = load_corpus()
    titles = {chunk.chunk_id: chunk.title for chunk in corpus}
    base = langchain_corpus_retriever("chroma", k=args.k)
    cache = ChunkCache()
    retriever = ChunkCacheRetriever(base_retriever=base, cache=cache, dedupe="drop")
    trace = multi_turn_trace(
        corpus, WorkloadConfig(num_conversations=args.warmup + args.show, seed=args.seed)
    )
    by_conversation = conversations(trace)
    shown = set(list(by_conversation)[-args.show :])

    tracker = PrefixTracker()
    requests: list[list[str]] = []
    retrieved = dropped = 0
    print(f"Replaying {len(trace)} turns of {len(by_conversation)} conversations...\n")
    for turn in trace:
        config: Any = {"configurable": {"conversation_id": turn.conversation_id}}
        base_ids = [chunk_id_for(d.page_content, d.metadata) for d in base.invoke(turn.question)]
        seen_before = cache.ledger.seen(turn.conversation_id)
        docs = retriever.invoke(turn.question, config=config)
        order = [d.metadata["chunk_id"] for d in docs]
        aligned = tracker.add(order)
        requests.append(order)
        turn_dropped = [cid for cid in base_ids if cid in seen_before]
        retrieved += len(base_ids)
        dropped += len(turn_dropped)
        if turn.conversation_id in shown:
            print(f"[{turn.conversation_id} turn {turn.turn_index + 1}] {turn.question}")
            for position, doc in enumerate(docs):
                rank = doc.metadata["retriever_rank"]
                print(
                    f"  {position + 1}. {titles.get(doc.metadata['chunk_id'], '?'):<48}"
                    f" (retriever rank {rank + 1})"
                )
            for cid in turn_dropped:
                print(f"  -  {titles.get(cid, '?'):<48} (already in this conversation: dropped)")
            share = aligned / len(order) if order else 0.0
            print(
                f"  prefix-aligned with an earlier request: {aligned}/{len(order)} = {share:.0%}\n"
            )

    print("Session summary")
    print(f"  requests: {len(requests)}, chunks retrieved: {retrieved}")
    print(f"  dropped as already in their conversation: {dropped} ({dropped / retrieved:.1%})")
    print(
        f"  CRAFT Prefix metric: {prefix_metric(requests):.3f}"
        f"   Total metric: {total_metric(requests):.3f}"
    )
    print(f"  state: {cache.stats()}")


if __name__ == "__main__":
    main()

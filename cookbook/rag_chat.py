"""The main job: a multi-turn RAG chat over the bundled corpus on the default model.

A LangChain app as anyone would write it (a Chroma retriever, a chat prompt, a
chat model, message history), with chunkcache's two drop-ins:
``ChunkCacheRetriever`` around the retriever and ``ChunkCacheLLM`` as the model.
Several conversations about the Python standard library run turn by turn, asking
about popular modules more often (Zipf-distributed topics), so with the defaults the
third conversation comes back to the first one's module: its chunks come from the
other conversation's cache, in a new order and new company.  Each turn prints the
answer, the time to first token and where the prompt's tokens came from (reused from
cache, recomputed, computed).  At the end the same last prompt runs once more with
full prefill, for the TTFT ratio.

    python cookbook/rag_chat.py [--conversations 3] [--turns 3] [--policy cacheblend]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from langchain_core.messages import BaseMessage

from chunkcache.core import default_cache
from chunkcache.core.corpus import load_corpus
from chunkcache.core.workload import TITLE_QUESTIONS, WorkloadConfig, multi_turn_trace
from chunkcache.integrations.indexes import langchain_corpus_retriever
from chunkcache.integrations.langchain import ChunkCacheLLM, ChunkCacheRetriever
from chunkcache.integrations.langchain_history import (
    InMemoryChatHistory,
    chunk_chat_prompt,
    with_chunk_history,
)

SYSTEM_PROMPT = (
    "You are a concise assistant for Python programmers. Answer the question in one or two "
    "sentences, using the context from the Python standard library documentation."
)


def main() -> None:
    parser = argparse.ArgumentParser(description="Multi-turn RAG chat with chunkcache.")
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--policy", default="cacheblend")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    print("Loading the corpus index and the default model (first run builds both)...")
    corpus = load_corpus()
    retriever = ChunkCacheRetriever(
        base_retriever=langchain_corpus_retriever("chroma", k=args.k), dedupe="drop"
    )
    llm = ChunkCacheLLM(recompute=args.policy, max_tokens=args.max_tokens)
    histories: dict[str, InMemoryChatHistory] = {}
    chain = with_chunk_history(
        chunk_chat_prompt(SYSTEM_PROMPT) | llm,
        retriever,
        lambda session_id: histories.setdefault(session_id, InMemoryChatHistory()),
    )
    config = WorkloadConfig(
        num_conversations=args.conversations,
        min_turns=args.turns,
        max_turns=args.turns,
        same_topic_probability=0.9,
        topic_zipf_s=1.5,  # RAG traffic is skewed: users meet on the popular chunks
        seed=args.seed,
        templates=TITLE_QUESTIONS,
    )
    turns = sorted(
        multi_turn_trace(corpus, config), key=lambda t: (t.conversation_id, t.turn_index)
    )
    rows: list[dict[str, Any]] = []
    for turn in turns:
        run_config: Any = {"configurable": {"session_id": turn.conversation_id}}
        answer: BaseMessage = chain.invoke({"question": turn.question}, config=run_config)
        stats = answer.response_metadata["chunkcache"]
        rows.append(stats)
        print(f"\n[{turn.conversation_id} turn {turn.turn_index + 1}] {turn.question}")
        print(f"  answer: {str(answer.content).strip()}")
        print(
            f"  TTFT {stats['ttft_s']:.2f} s | prompt {stats['prompt_tokens']} tokens: "
            f"{stats['reused_tokens']} reused, {stats['recomputed_tokens']} recomputed, "
            f"{stats['computed_tokens']} computed | chunks {stats['chunk_hits']} hit, "
            f"{stats['chunk_misses']} missed"
        )

    prompt_tokens = sum(r["prompt_tokens"] for r in rows)
    reused = sum(r["reused_tokens"] for r in rows)
    print("\nSession summary")
    print(f"  turns: {len(rows)}, prompt tokens: {prompt_tokens}")
    print(f"  reused from cache: {reused} ({reused / prompt_tokens:.0%} of prompt tokens)")
    print(f"  median TTFT: {statistics.median(r['ttft_s'] for r in rows):.2f} s ({args.policy})")
    last = turns[-1]
    history = histories[last.conversation_id].messages[:-2]  # the last turn, asked again
    messages = chunk_chat_prompt(SYSTEM_PROMPT).invoke(
        {"history": history, "turn": [histories[last.conversation_id].messages[-2]]}
    )
    baseline = llm.invoke(messages, recompute="full", max_tokens=1)
    full_ttft = baseline.response_metadata["chunkcache"]["ttft_s"]
    print(
        f"  last prompt with full prefill: TTFT {full_ttft:.2f} s vs {rows[-1]['ttft_s']:.2f} s "
        f"with {args.policy} ({full_ttft / rows[-1]['ttft_s']:.1f}x faster)"
    )
    print(f"  cache state: {default_cache().stats()}")


if __name__ == "__main__":
    main()

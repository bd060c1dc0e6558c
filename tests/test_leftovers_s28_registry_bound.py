"""The chunk registry's text bound is fixed (256 Mi characters), whatever the model's window
or the cache's ``window``: it is memory, and it is far more text than any KV store holds the
KV of, so scaling it would cost memory for chunks with nothing left to reuse.  A 128k-window
app keeps the chunks of its last 512 window-filling prompts (at 4 characters a token), and a
conversation's chunks, looked up each turn, stay however much else comes and goes.

Texts are one shared string registered under many ids: the registry counts characters, so the
test costs no memory.
"""

from __future__ import annotations

import pytest

from chunkcache.core.cache import ChunkCache
from chunkcache.core.chunk_ids import chunk_id
from chunkcache.core.registry import DEFAULT_MAX_CHARS, ChunkRegistry

WINDOW_TOKENS = 128 * 1024
CHARS_PER_TOKEN = 4  # English text in a Llama-family tokenizer, about
CHUNKS_PER_PROMPT = 8
CHUNK = "x" * (WINDOW_TOKENS * CHARS_PER_TOKEN // CHUNKS_PER_PROMPT)  # 16k tokens


def long_context_cache() -> ChunkCache:
    # A vllm backend is named, never built: the registry's bounds do not ask the model.
    return ChunkCache(backend="vllm", base_url="http://127.0.0.1:1", model="long-context")


def register_prompt(registry: ChunkRegistry, n: int) -> list[str]:
    """Register the chunks of the ``n``-th prompt, which fill a 128k window; their ids."""
    ids = [chunk_id(f"prompt {n} chunk {i}") for i in range(CHUNKS_PER_PROMPT)]
    for cid in ids:
        assert registry.register(cid, CHUNK)
    return ids


@pytest.mark.parametrize("window", [10, 1_000, 10_000])
def test_the_text_bound_is_fixed_and_the_chunk_bound_follows_the_window(window: int) -> None:
    cache = ChunkCache(window=window, backend="vllm", base_url="http://127.0.0.1:1", model="m")
    assert cache.registry.max_chars == DEFAULT_MAX_CHARS == 256 * 2**20
    assert cache.registry.max_chunks == 20 * window


def test_a_128k_window_app_keeps_the_chunks_of_its_last_512_full_prompts() -> None:
    registry = long_context_cache().registry
    prompts = [register_prompt(registry, n) for n in range(512)]
    assert all(cid in registry for ids in prompts for cid in ids)
    assert registry.num_chars == DEFAULT_MAX_CHARS
    register_prompt(registry, 512)  # the oldest prompt's chunks go, and only they
    assert not any(cid in registry for cid in prompts[0])
    assert all(cid in registry for ids in prompts[1:] for cid in ids)


def test_a_conversations_chunks_looked_up_each_turn_outlive_any_traffic() -> None:
    """The LLM side looks up the chunks a conversation's history holds on every turn
    (``held_chunk_ids``): they stay the most recently used."""
    registry = long_context_cache().registry
    conversation = register_prompt(registry, 0)
    for n in range(1, 2_001):
        register_prompt(registry, n)
        if n % 100 == 0:  # a turn of the conversation, every 100 other prompts
            assert all(registry.get(cid) == CHUNK for cid in conversation)
    assert len(registry) == 512 * CHUNKS_PER_PROMPT

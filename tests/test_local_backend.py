"""The local backend on a tiny model: tokenization per segment, streaming, stop, stats."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from tiny_models import tiny_lm, tiny_tokenizer

from chunkcache.core.cache import ChunkCache
from chunkcache.core.engine import ChunkEngine, Prefilled
from chunkcache.core.errors import InvalidTextError
from chunkcache.core.generation import (
    GenerationChunk,
    GenerationRequest,
    GenerationStats,
    Policy,
    SamplingParams,
)
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.sampling import StopChecker
from chunkcache.core.segmenter import ChunkSegment, TextSegment
from chunkcache.integrations.langchain_llm import ChunkCacheLLM as LangChainLLM
from chunkcache.integrations.llama_index_llm import ChunkCacheLLM as LlamaIndexLLM

CHUNK = ChunkSegment("chunk-1", "the quick brown fox jumps over the lazy dog " * 3)


@pytest.fixture(scope="module")
def backend() -> LocalBackend:
    lm = tiny_lm("llama")
    lm_with_tokenizer = LoadedModel(lm.hf, tiny_tokenizer(), lm.spec, lm.rope, lm.fingerprint)
    return LocalBackend(ChunkEngine(lm_with_tokenizer))


def run(backend: LocalBackend, **kwargs: object) -> tuple[str, object]:
    request = GenerationRequest(
        [TextSegment("system: answer. "), CHUNK, TextSegment(" question?")],
        sampling=SamplingParams(max_tokens=8),
        **kwargs,  # type: ignore[arg-type]
    )
    pieces = list(backend.stream(request))
    assert all(piece.stats is None for piece in pieces[:-1])
    return "".join(piece.text for piece in pieces), pieces[-1].stats


def test_second_request_reuses_the_chunk(backend: LocalBackend) -> None:
    _, first = run(backend, policy="full")
    _, second = run(backend, policy="cacheblend")
    assert first.chunk_misses == 1  # type: ignore[attr-defined]
    assert second.reused_tokens > 0  # type: ignore[attr-defined]
    assert second.completion_tokens > 0  # type: ignore[attr-defined]


def test_policies_agree_on_an_exact_prefix(backend: LocalBackend) -> None:
    full_text, _ = run(backend, policy="full")
    prefix_text, stats = run(backend, policy="prefix")
    assert prefix_text == full_text
    assert stats.computed_tokens == 1  # type: ignore[attr-defined]


def test_a_chunk_id_sent_with_another_text_never_serves_the_old_one(
    backend: LocalBackend,
) -> None:
    """A caller's id is bound to its text: an edited document, or another tenant's text
    under the same id, is a miss computed from the text sent, never the old tokens or KV."""

    def ask(text: str, policy: Policy) -> GenerationStats:
        request = GenerationRequest(
            [TextSegment("system: answer. "), ChunkSegment("doc-7", text), TextSegment(" q?")],
            sampling=SamplingParams(max_tokens=1),
            policy=policy,
        )
        stats = list(backend.stream(request))[-1].stats
        assert stats is not None
        return stats

    old, new = "the old text of the doc " * 3, "another, longer and newer text of it " * 3
    ask(old, "full")
    edited = ask(new, "reuse")
    assert (edited.chunk_hits, edited.chunk_misses) == (0, 1)
    assert edited.prompt_tokens == ask(new, "full").prompt_tokens
    assert ask(new, "reuse").chunk_hits == 1
    assert ask(old, "reuse").chunk_hits == 1  # the old text keeps its own entry


@pytest.mark.parametrize("where", ["text", "chunk"])
def test_a_lone_surrogate_is_refused_with_a_clear_error(backend: LocalBackend, where: str) -> None:
    bad = "half an emoji: \ud83d."
    segment = TextSegment(bad) if where == "text" else ChunkSegment("chunk-bad", bad * 2)
    request = GenerationRequest(
        [TextSegment("system: "), segment], sampling=SamplingParams(max_tokens=1)
    )
    with pytest.raises(InvalidTextError, match=r"not valid Unicode: \\ud83d at character 15"):
        list(backend.stream(request))
    assert run(backend, policy="full")[0]  # the backend still answers


def test_stop_checker_holds_back_a_possible_stop_prefix() -> None:
    checker = StopChecker(("STOP",))
    assert checker.split("abc ST") == ("abc", False)
    assert checker.split("abc STOP more") == ("abc ", True)
    assert checker.final("abc ST") == "abc ST"


class CountingEngine(ChunkEngine):
    """Counts the tokens its decode yields, and whether that decode was closed."""

    decoded = 0
    closed = False

    def decode(self, prefilled: Prefilled, params: SamplingParams) -> Iterator[int]:
        try:
            for token in super().decode(prefilled, params):
                self.decoded += 1
                yield token
        finally:
            self.closed = True


def test_closing_a_stream_stops_decoding_at_once() -> None:
    engine = CountingEngine(tiny_lm("llama"))
    backend = LocalBackend(engine)
    words = " ".join(f"w{(14 + i * 3) % 120}" for i in range(16))
    request = GenerationRequest([TextSegment(words)], sampling=SamplingParams(max_tokens=300))
    stream = backend.stream(request)
    assert next(stream).text
    decoded = engine.decoded
    stream.close()
    assert engine.closed and engine.decoded == decoded < 300
    # the engine is free again: the next request runs at once
    after = ThreadPoolExecutor(1).submit(lambda: list(backend.stream(request)))
    assert after.result(timeout=60)[-1].stats is not None


class GatedEngine(ChunkEngine):
    """Counts its prefills; each waits for ``gate`` once it began."""

    def __init__(self, lm: LoadedModel) -> None:
        super().__init__(lm)
        self.gate = threading.Event()
        self.started = threading.Event()
        self.prefills = 0

    def prefill(self, *args: Any, **kwargs: Any) -> Prefilled:
        self.prefills += 1
        self.started.set()
        assert self.gate.wait(timeout=30)
        return super().prefill(*args, **kwargs)


def long_request(seed: int) -> GenerationRequest:
    words = " ".join(f"w{(seed + i * 3) % 120}" for i in range(16))
    return GenerationRequest([TextSegment(words)], sampling=SamplingParams(max_tokens=12))


def test_streams_interleaved_on_one_thread_each_get_their_own_answer() -> None:
    """The engine is held per step, never across a yield: zip() of two streams, or a
    stream its consumer paused, does not hold up the other request."""
    backend = LocalBackend(ChunkEngine(tiny_lm("llama")))
    alone = [collect(backend.stream(long_request(seed))) for seed in (14, 40)]
    first, second = backend.stream(long_request(14)), backend.stream(long_request(40))
    head = next(first).text  # paused mid-answer
    other_thread = ThreadPoolExecutor(1).submit(collect, backend.stream(long_request(40)))
    assert other_thread.result(timeout=60) == alone[1]
    texts = [head, ""]
    for pieces in itertools.zip_longest(first, second):
        for i, piece in enumerate(pieces):
            texts[i] += piece.text if piece is not None else ""
    assert texts == alone


def test_a_stream_cancelled_while_waiting_for_the_engine_never_prefills() -> None:
    engine = GatedEngine(tiny_lm("llama"))
    backend = LocalBackend(engine)
    busy = ThreadPoolExecutor(1).submit(collect, backend.stream(long_request(14)))
    assert engine.started.wait(timeout=30)  # the engine is busy with the first request
    waiting = backend.stream(long_request(40))
    pieces = ThreadPoolExecutor(1).submit(list, waiting)
    waiting.cancel()
    assert pieces.result(timeout=30) == []  # it just ends, from its own thread
    engine.gate.set()
    assert busy.result(timeout=60)
    assert engine.prefills == 1


def collect(stream: Iterator[GenerationChunk]) -> str:
    return "".join(piece.text for piece in stream)


@pytest.mark.parametrize("framework", ["langchain", "llama_index"])
def test_a_cancelled_async_call_never_runs_while_it_waits(framework: str) -> None:
    """ainvoke / acomplete: cancelling the task stops the request, not just the awaiting."""
    lm, tokenizer = tiny_lm("llama"), tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    engine = GatedEngine(LoadedModel(lm.hf, tokenizer, lm.spec, lm.rope, lm.fingerprint))
    cache = ChunkCache(backend=LocalBackend(engine))
    call: Callable[[str], Coroutine[Any, Any, object]]
    if framework == "langchain":
        call = LangChainLLM(chunk_cache=cache, max_tokens=4).ainvoke
    else:
        call = LlamaIndexLLM(cache=cache, max_tokens=4).acomplete

    async def scenario() -> None:
        busy = asyncio.create_task(call("w1 w2 w3"))
        assert await asyncio.to_thread(engine.started.wait, 30)
        waiting = asyncio.create_task(call("w4 w5 w6"))
        await asyncio.sleep(0.3)  # now waiting for the engine
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        engine.gate.set()
        await busy
        await asyncio.sleep(0.3)  # room for a request that was not really stopped

    asyncio.run(scenario())
    assert engine.prefills == 1


def test_closing_a_stream_from_another_thread_stops_it() -> None:
    backend = LocalBackend(ChunkEngine(tiny_lm("llama")))
    stream = backend.stream(long_request(14))
    with backend._lock:  # another request holds the engine: the stream waits inside next()
        pieces = ThreadPoolExecutor(1).submit(list, stream)
        time.sleep(0.2)
        stream.close()  # mid-next on the consuming thread: no "generator already executing"
    assert pieces.result(timeout=30) == []

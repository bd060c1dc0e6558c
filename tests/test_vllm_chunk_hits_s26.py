"""VllmBackend's chunk_hits and chunk_misses: a chunk is a hit when all of its tokens lie in
the prefix vLLM reports cached.  A fake server stands in for vLLM: it tokenizes the prompt
with SmolLM2's tokenizer as vLLM's /v1/completions does (``encode``, whole prompt, no special
tokens added) and, unless told a number, caches as vLLM's automatic prefix caching does
(whole 16-token blocks from the start, never the prompt's last token)."""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from chunkcache.core.cache import ChunkCache
from chunkcache.core.generation import GenerationRequest, GenerationStats, SamplingParams
from chunkcache.core.model_files import pull_default_model
from chunkcache.core.prompting import generate
from chunkcache.core.segmenter import ChunkSegment, Segment, TextSegment
from chunkcache.integrations.langchain import ChunkCacheLLM
from chunkcache.integrations.vllm import VllmBackend

BLOCK = 16
HEAD = "<|im_start|>user\nAnswer from the context.\n\n"
QUESTION = "\n\nWhich of the facts above mentions the harbour of Valparaíso, and when?<|im_end|>\n"
FACTS = [
    f"Fact {i}: the warehouse in district {i} stores {i * 37} crates of tea." for i in range(60)
]
UNICODE = [
    "Zürich: 東京の倉庫は月曜日に開きます — naïve café, crème brûlée 😀",
    "Ελληνικά και русский текст, 한국어 문장 🧪🧬",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(pull_default_model())


def vllm_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt's token ids as vLLM reads them (vllm/renderers: ``encode``, whole prompt)."""
    return list(tokenizer.encode(prompt, add_special_tokens=False))


class FakeVllm:
    """``/v1/models`` (``window``) and a ``/v1/completions`` that reports the prompt's tokens
    and its cached ones: ``cached`` when set, else the longest run of whole blocks it has seen
    before (vLLM caches at most the prompt's length - 1)."""

    def __init__(
        self, tokenizer: Any, cached: int | None = None, report_cached: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.cached = cached
        self.report_cached = report_cached
        self.seen: set[tuple[int, ...]] = set()
        self.window: int | None = 8192

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            model = {"id": "smol", "max_model_len": self.window}
            return httpx.Response(200, json={"data": [model]})
        ids = vllm_ids(self.tokenizer, json.loads(request.content)["prompt"])
        usage: dict[str, Any] = {"prompt_tokens": len(ids), "completion_tokens": 1}
        if self.report_cached:
            usage["prompt_tokens_details"] = {"cached_tokens": self.prefix_cache(ids)}
        events = [
            {"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}], "usage": None},
            {"choices": [], "usage": usage},
        ]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=body.encode())

    def prefix_cache(self, ids: list[int]) -> int:
        blocks = [tuple(ids[: end + BLOCK]) for end in range(0, len(ids) - BLOCK + 1, BLOCK)]
        hit = 0
        for prefix in blocks:
            if prefix not in self.seen or len(prefix) > len(ids) - 1:
                break
            hit = len(prefix)
        self.seen.update(blocks)
        return hit if self.cached is None else self.cached

    def backend(self, tokenizer: Any = None) -> VllmBackend:
        return VllmBackend(
            "http://vllm.test",
            "smol",
            tokenizer=tokenizer or self.tokenizer,
            transport=httpx.MockTransport(self),
        )


def request(segments: Sequence[Segment]) -> GenerationRequest:
    return GenerationRequest(list(segments), sampling=SamplingParams(max_tokens=1))


def rag(chunks: Sequence[str]) -> list[Segment]:
    """HEAD, the chunks one a line, QUESTION."""
    segments: list[Segment] = [TextSegment(HEAD)]
    for i, text in enumerate(chunks):
        segments += [ChunkSegment(f"c{i}", text), TextSegment("\n")]
    return [*segments[:-1], TextSegment(QUESTION)]


def counts(stats: GenerationStats) -> tuple[int, int, int]:
    return stats.chunk_hits, stats.chunk_misses, stats.extra["unmeasured_chunks"]


def tokens_through(tokenizer: Any, segments: Sequence[Segment], last: int) -> int:
    """How many tokens the prompt has up to the end of segment ``last``, each test's chunks
    ending where no token spans the boundary (a chunk's end, then a newline)."""
    return len(vllm_ids(tokenizer, "".join(s.text for s in segments[: last + 1])))


def test_sixty_chunks_cold_then_all_cached(tokenizer: Any) -> None:
    """The report: 60 chunks, nearly all the prompt cached, and chunk_hits 0, chunk_misses 0."""
    server = FakeVllm(tokenizer)
    backend = server.backend()
    _, cold = generate(backend, request(rag(FACTS)))
    _, warm = generate(backend, request(rag(FACTS)))
    assert cold.reused_tokens == 0 and counts(cold) == (0, 60, 0)
    assert warm.reused_tokens >= warm.prompt_tokens - BLOCK
    assert counts(warm) == (60, 0, 0)


def test_an_edited_chunk_is_a_miss_and_so_is_every_chunk_after_it(tokenizer: Any) -> None:
    """vLLM reuses a prefix only: the chunks before the edit hit, the rest miss."""
    server = FakeVllm(tokenizer)
    backend = server.backend()
    generate(backend, request(rag(FACTS)))
    segments = rag([*FACTS[:40], FACTS[40].replace("tea", "rice"), *FACTS[41:]])
    _, stats = generate(backend, request(segments))
    ends = [tokens_through(tokenizer, segments, 2 * i + 1) for i in range(60)]
    hits = sum(end <= stats.reused_tokens for end in ends)
    assert 0 < stats.reused_tokens < ends[40] and hits in (39, 40)
    assert counts(stats) == (hits, 60 - hits, 0)


def test_a_chunk_ending_inside_a_cached_block_is_a_hit_the_one_across_it_a_miss(
    tokenizer: Any,
) -> None:
    segments = rag(FACTS[:3])
    first_end = tokens_through(tokenizer, segments, 1)  # HEAD, chunk 0
    cached = (first_end // BLOCK + 1) * BLOCK  # the block chunk 0 ends in, and chunk 1 starts
    assert first_end % BLOCK and cached < tokens_through(tokenizer, segments, 3)
    _, stats = generate(FakeVllm(tokenizer, cached=cached).backend(), request(segments))
    assert counts(stats) == (1, 2, 0)


@pytest.mark.parametrize(("short", "expected"), [(0, (1, 1, 0)), (1, (0, 2, 0))])
def test_a_chunk_is_a_hit_only_with_its_last_token_cached(
    tokenizer: Any, short: int, expected: tuple[int, int, int]
) -> None:
    segments = rag(FACTS[:2])
    cached = tokens_through(tokenizer, segments, 1) - short
    _, stats = generate(FakeVllm(tokenizer, cached=cached).backend(), request(segments))
    assert counts(stats) == expected


@pytest.fixture(scope="module")
def trimming_tokenizer(tokenizer: Any) -> Any:
    """SmolLM2's tokenizer reporting offsets as GPT-2's does: a token's leading space left out
    of its span (``trim_offsets``), the ids unchanged."""
    trimming = copy.deepcopy(tokenizer)
    trimming.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    return trimming


@pytest.mark.parametrize("trims", [False, True])
def test_a_chunks_last_space_held_by_an_uncached_token_is_a_miss(
    tokenizer: Any, trimming_tokenizer: Any, trims: bool
) -> None:
    """``" Which"`` is one token that holds the chunk's trailing space: cached up to the
    chunk's last word, the chunk is not all cached."""
    segments: list[Segment] = [
        TextSegment(HEAD),
        ChunkSegment("c0", FACTS[0] + " "),
        TextSegment("Which?"),
    ]
    cached = len(vllm_ids(tokenizer, HEAD + FACTS[0]))
    assert cached + 2 == len(vllm_ids(tokenizer, "".join(s.text for s in segments)))
    backend = FakeVllm(tokenizer, cached=cached).backend(trimming_tokenizer if trims else None)
    _, stats = generate(backend, request(segments))
    assert counts(stats) == (0, 1, 0)
    _, stats = generate(FakeVllm(tokenizer, cached=cached + 1).backend(), request(segments))
    assert counts(stats) == (1, 0, 0)


def test_a_chunk_twice_is_counted_at_each_place(tokenizer: Any) -> None:
    segments = rag([FACTS[0], FACTS[1], FACTS[0]])
    cached = tokens_through(tokenizer, segments, 3)  # the first two chunks
    _, stats = generate(FakeVllm(tokenizer, cached=cached).backend(), request(segments))
    assert counts(stats) == (2, 1, 0)
    _, cold = generate(FakeVllm(tokenizer, cached=0).backend(), request(segments))
    assert counts(cold) == (0, 3, 0)


@pytest.mark.parametrize(("short", "expected"), [(0, (1, 1, 0)), (1, (0, 2, 0))])
def test_unicode_chunks_map_to_their_tokens(
    tokenizer: Any, short: int, expected: tuple[int, int, int]
) -> None:
    """The first chunk ends in an emoji that is two tokens (four bytes): with one of them
    uncached, the chunk is a miss."""
    segments = rag(UNICODE)
    cached = tokens_through(tokenizer, segments, 1) - short
    assert len(vllm_ids(tokenizer, "😀")) > 1  # the last character splits over tokens
    _, stats = generate(FakeVllm(tokenizer, cached=cached).backend(), request(segments))
    assert counts(stats) == expected


def test_unicode_chunks_cold_then_warm(tokenizer: Any) -> None:
    backend = FakeVllm(tokenizer).backend()
    segments = rag([*UNICODE, *FACTS[:5]])
    assert counts(generate(backend, request(segments))[1]) == (0, 7, 0)
    assert counts(generate(backend, request(segments))[1]) == (7, 0, 0)


def test_unreported_cached_tokens_leave_the_chunks_unmeasured_not_missed(tokenizer: Any) -> None:
    """Without --enable-prompt-tokens-details nothing is known: 0 misses, all unmeasured."""
    backend = FakeVllm(tokenizer, report_cached=False).backend()
    with pytest.warns(UserWarning, match="unmeasured_chunks"):
        _, stats = generate(backend, request(rag(FACTS[:4])))
    assert counts(stats) == (0, 0, 4)


def test_a_tokenizer_that_counts_otherwise_than_vllm_leaves_the_chunks_unmeasured(
    tokenizer: Any,
) -> None:
    """The server's prompt_tokens differ from the local count: the offsets are not vLLM's."""

    class Server(FakeVllm):
        def __call__(self, request: httpx.Request) -> httpx.Response:
            if request.url.path == "/v1/completions":
                body = json.loads(request.content)
                request = httpx.Request(
                    "POST", request.url, json={**body, "prompt": body["prompt"] + " extra"}
                )
            return super().__call__(request)

    _, stats = generate(Server(tokenizer, cached=32).backend(), request(rag(FACTS[:2])))
    assert counts(stats) == (0, 0, 2)


class CountingTokenizer:
    """SmolLM2's tokenizer, counting how often a prompt is tokenized."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.tokenizer(*args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.tokenizer.encode(*args, **kwargs)


@pytest.mark.parametrize("window", [2048, None])
def test_the_prompt_is_tokenized_once_per_request(tokenizer: Any, window: int | None) -> None:
    """The window check's count and the chunk counts come from one tokenization."""
    server = FakeVllm(tokenizer, cached=64)
    server.window = window
    counting = CountingTokenizer(tokenizer)
    _, stats = generate(server.backend(counting), request(rag(FACTS[:5])))
    assert counting.calls == 1
    assert stats.chunk_hits + stats.chunk_misses == 5


def test_a_prompt_without_chunks_is_not_tokenized_for_counts(tokenizer: Any) -> None:
    server = FakeVllm(tokenizer, cached=0)
    server.window = None
    counting = CountingTokenizer(tokenizer)
    _, stats = generate(server.backend(counting), request([TextSegment(HEAD + QUESTION)]))
    assert counting.calls == 0 and counts(stats) == (0, 0, 0)


def test_a_server_with_no_window_and_no_local_tokenizer_still_answers(tokenizer: Any) -> None:
    """The counts are the only use of a tokenizer there: none to load is unmeasured chunks,
    not a failed request."""
    server = FakeVllm(tokenizer, cached=16)
    server.window = None
    backend = VllmBackend(
        "http://vllm.test", "no-such-local-model", transport=httpx.MockTransport(server)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text, stats = generate(backend, request(rag(FACTS[:2])))
    assert text == "ok" and counts(stats) == (0, 0, 2)


def test_langchain_reports_the_chunk_hits_of_a_repeated_rag_prompt(tokenizer: Any) -> None:
    cache = ChunkCache(backend=FakeVllm(tokenizer).backend())
    for i, text in enumerate(FACTS):
        cache.registry.register(f"fact-{i}", text)
    llm = ChunkCacheLLM(chunk_cache=cache, max_tokens=1)
    context = "\n".join(FACTS)
    messages = [("system", "Answer from the context."), ("human", f"{context}\n\nWhich?")]
    first, second = (llm.invoke(messages).response_metadata["chunkcache"] for _ in range(2))
    assert (first["chunk_hits"], first["chunk_misses"]) == (0, 60)
    assert (second["chunk_hits"], second["chunk_misses"]) == (60, 0)
    assert second["extra"]["unmeasured_chunks"] == 0

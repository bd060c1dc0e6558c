"""Differential probe of the HTTP path: seeded random request sequences sent to two identical
engines, one in process (``LocalBackend``) and one behind ``chunkcache serve`` reached by
``HttpBackend`` (a tiny random Llama under SmolLM2's tokenizer and chat template, float32).

A user who switches ``backend="local"`` to ``backend="http"`` gets the same pieces, text,
stats and errors: several conversations, chunks repeated in new orders, every recompute
policy and ratio, greedy and seeded sampling, stop strings, max_tokens 1..N, streamed and
whole, chat messages, templated prompts and hand-built segments, and bad input.  The server
runs the one-at-a-time local backend and, as ``chunkcache serve`` does by default, the
continuous-batching one."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import pytest
from fake_backend import FakeBackend
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from test_history_token_budget import (
    WINDOW,
    one_torch_thread,  # noqa: F401  (autouse)
    tiny_smollm2,  # noqa: F401  (fixture)
)

from chunkcache.core.batching import BatchingBackend
from chunkcache.core.cache import ChunkCache
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.errors import (
    EmptyPromptError,
    InvalidConversationIdError,
    InvalidTextError,
    PromptTooLongError,
)
from chunkcache.core.generation import (
    POLICIES,
    Backend,
    GenerationChunk,
    GenerationRequest,
    GenerationStats,
    SamplingParams,
)
from chunkcache.core.http_backend import HttpBackend
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.models import LoadedModel
from chunkcache.core.prompting import build_request, generate
from chunkcache.core.segmenter import ChunkSegment, Segment, TextSegment
from chunkcache.core.serve import create_app
from chunkcache.core.serve.launcher import serve_app
from chunkcache.integrations.langchain_llm import ChunkCacheLLM

SEED = 28
STEPS = 40
CONVERSATIONS = ("conv-a", "conv-b", "conv-c", None)
RATIOS = (0.0, 0.05, 0.15, 0.5, 1.0)
WORDS = (
    *("river", "bank", "ledger", "depot", "crate", "north", "harbour", "signal", "copper"),
    *("lantern", "meadow", "orbit", "parcel", "quartz", "saddle", "timber", "violet"),
    *("café", "Zürich", "naïve", "façade", "東京", "🙂", "42", "1999"),
)
SYSTEM = "Answer from the context."
# What the server adds in front of the message of an error it answers: the rest is the
# message the local backend raises.
REFUSED = "chunkcache serve refused the request (400): "


@dataclass
class Side:
    """One path: its backend, and a LangChain ChunkCacheLLM on it."""

    backend: Backend

    def __post_init__(self) -> None:
        self.llm = ChunkCacheLLM(chunk_cache=ChunkCache(backend=self.backend))


@dataclass
class Paths:
    """The same model behind both paths, and the client's chunk cache (chunks registered as
    a retriever registers them) that builds every request."""

    local: Side
    http: Side
    cache: ChunkCache


@pytest.fixture(scope="module", params=["local", "batching"])
def paths(request: pytest.FixtureRequest, tiny_smollm2: LoadedModel) -> Iterator[Paths]:  # noqa: F811
    served: Backend = (
        LocalBackend(ChunkEngine(tiny_smollm2))
        if request.param == "local"
        else BatchingBackend(ChunkEngine(tiny_smollm2))
    )
    with serve_app(create_app(served)) as url:
        http = HttpBackend(url)
        yield Paths(Side(LocalBackend(ChunkEngine(tiny_smollm2))), Side(http), ChunkCache())
        http.close()


# --- what must agree ------------------------------------------------------------------------


# Stats that differ for a reason: ``ttft_s`` and ``total_s`` are each side's own clock (the
# served request also waits on the event loop and a worker thread); the batching backend adds
# ``extra["queue_s"]``, a clock too, and ``extra["batch_size"]``, how it batched the request,
# which the one-at-a-time local backend has no notion of.
CLOCKS = ("ttft_s", "total_s")
BATCHING_EXTRA = ("queue_s", "batch_size")


def comparable(stats: GenerationStats) -> dict[str, Any]:
    """The stats both paths must agree on: all but the clocks and batching's own."""
    values = {k: v for k, v in stats.as_dict().items() if k not in CLOCKS}
    values["extra"] = {k: v for k, v in stats.extra.items() if k not in BATCHING_EXTRA}
    return values


def pieces_of(pieces: Sequence[GenerationChunk]) -> list[tuple[str, dict[str, Any] | None]]:
    """A stream's pieces as they must agree: each one's text, and the last one's stats (the
    text held back to the end, for a stop string or a character's last bytes, comes with
    them on both paths)."""
    return [(p.text, None if p.stats is None else comparable(p.stats)) for p in pieces]


def outcome(run: Callable[[], Any]) -> Any:
    """``run()``'s result, or its error as (class, message without the server's prefix)."""
    try:
        return run()
    except Exception as error:  # the error is what is compared
        return (type(error), str(error).removeprefix(REFUSED))


# --- the random requests --------------------------------------------------------------------


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


@dataclass
class Probe:
    """Draws the next request from ``rng`` and sends it down both paths."""

    paths: Paths
    rng: random.Random
    chunks: list[tuple[str, str]]
    chats: dict[str | None, list[dict[str, str]]] = field(default_factory=dict)
    last: tuple[GenerationRequest, str] | None = None
    kinds: list[str] = field(default_factory=list)

    def step(self) -> None:
        kinds = ("templated", "chat", "segments", "stopped", "langchain", "edge")
        kind = self.rng.choices(kinds, weights=(5, 4, 3, 3, 2, 2))[0]
        if kind == "stopped" and self.last is None:
            kind = "templated"
        self.kinds.append(kind)
        getattr(self, kind)()

    # -- options --

    def some_chunks(self) -> list[tuple[str, str]]:
        """1 to 4 of the chunks, in a new order."""
        return self.rng.sample(self.chunks, self.rng.randint(1, 4))

    def options(self) -> dict[str, Any]:
        """build_request's options: policy, ratio, conversation, max_tokens, sampling."""
        rng = self.rng
        greedy = rng.random() < 0.5
        return {
            "recompute": rng.choice(POLICIES),
            "recompute_ratio": rng.choice((*RATIOS, round(rng.random(), 3))),
            "conversation_id": rng.choice(CONVERSATIONS),
            "max_tokens": rng.randint(1, 24),
            "temperature": 0.0 if greedy else rng.choice((0.5, 1.0, 1.5)),
            "top_p": 1.0 if greedy else rng.choice((1.0, 0.8)),
            "seed": rng.randrange(2**63),
        }

    # -- the kinds of step --

    def templated(self) -> None:
        """A RAG prompt built by the app's own template, its chunks found by the segmenter."""
        context = "\n\n".join(text for _, text in self.some_chunks())
        prompt = f"{SYSTEM}\n\n{context}\n\nQuestion: {sentence(self.rng, 5)}"
        self.send(build_request(prompt, self.paths.cache, **self.options()))

    def chat(self) -> None:
        """A conversation's next turn: its past turns, answers included, then new context."""
        options = self.options()
        turns = self.chats.setdefault(options["conversation_id"], [])
        context = "\n\n".join(text for _, text in self.some_chunks())
        turns.append({"role": "user", "content": f"{context}\n\n{sentence(self.rng, 4)}"})
        messages = [{"role": "system", "content": SYSTEM}, *turns]
        prompt = self.paths.local.backend.render_chat(messages)
        assert self.paths.http.backend.render_chat(messages) == prompt
        answer = self.send(build_request(prompt, self.paths.cache, **options))
        turns.append({"role": "assistant", "content": answer or ""})

    def segments(self) -> None:
        """A request whose segments the caller built: adjacent text segments, a chunk too
        short for the segmenter, a chunk's text also in plain text, one id on two texts."""
        rng = self.rng
        segments: list[Segment] = [TextSegment(SYSTEM), TextSegment(" Context: ")]
        for cid, text in self.some_chunks():
            segments.append(ChunkSegment(cid, text))
            segments.append(TextSegment(rng.choice((" ", "\n", " and "))))
        odd = rng.choice(("short", "also_text", "same_id", "none"))
        if odd == "short":
            segments.append(ChunkSegment("short", sentence(rng, 2)))
        elif odd == "also_text":
            segments.append(TextSegment(f" Again: {self.chunks[0][1]} "))
        elif odd == "same_id":
            segments.append(ChunkSegment(self.chunks[0][0], self.chunks[1][1]))
        segments.append(TextSegment(f" Question: {sentence(rng, 4)}"))
        options = self.options()
        sampling = SamplingParams(
            max_tokens=options["max_tokens"],
            temperature=options["temperature"],
            top_p=options["top_p"],
            seed=options["seed"],
        )
        request = GenerationRequest(
            segments,
            conversation_id=options["conversation_id"],
            policy=options["recompute"],
            recompute_ratio=options["recompute_ratio"],
            sampling=sampling,
        )
        self.send(request)

    def stopped(self) -> None:
        """The last request again with stop strings: a piece of its answer (it stops there
        when the answer comes again) and strings that never come."""
        assert self.last is not None
        request, answer = self.last
        stops = [f"never-{self.rng.randrange(100)}"]
        if len(answer) > 2:
            start = self.rng.randrange(1, len(answer) - 1)
            stops.append(answer[start : start + self.rng.randint(1, 6)])
        sampling = replace(request.sampling, stop=tuple(self.rng.sample(stops, len(stops))))
        self.send(replace(request, sampling=sampling))

    def langchain(self) -> None:
        """ChunkCacheLLM on each backend: invoked or streamed, its chunks named per call."""
        options = self.options()
        picked = self.some_chunks()
        context = "\n\n".join(text for _, text in picked)
        messages: list[BaseMessage] = [
            SystemMessage(SYSTEM),
            HumanMessage(f"{context}\n\n{sentence(self.rng, 4)}"),
        ]
        if self.rng.random() < 0.5:
            messages[1:1] = [HumanMessage(sentence(self.rng, 3)), AIMessage(sentence(self.rng, 3))]
        streamed = self.rng.random() < 0.5
        call = {
            "chunks": picked,
            "conversation_id": options.pop("conversation_id") or "lc",
            **options,
        }

        def run(side: Side) -> Any:
            if streamed:
                return streamed_messages(side.llm.stream(messages, **call))
            return message_of(side.llm.invoke(messages, **call))

        self.agree(run)

    def edge(self) -> None:
        """One of :meth:`edges`."""
        edges = self.edges()
        name = self.rng.choice(sorted(edges))
        self.kinds[-1] = f"edge: {name}"
        self.agree(lambda side: whole(side.backend, edges[name]()))

    def edges(self) -> dict[str, Callable[[], GenerationRequest]]:
        """Bad input, which both paths refuse alike, and prompts at the window's edge."""
        cache, rng = self.paths.cache, self.rng
        long_prompt = sentence(rng, 1500)  # more tokens than the window holds
        near = sentence(rng, 620)  # about 960 tokens: a few dozen short of the window
        return {
            "fit to the window": lambda: build_request(
                near, cache, max_tokens=256, fit_window=True
            ),
            "blank prompt": lambda: build_request(" \n ", cache, max_tokens=3),
            "empty prompt": lambda: build_request("", cache),
            "blank segment": lambda: GenerationRequest([TextSegment("")]),
            "over the window": lambda: build_request(long_prompt, cache, max_tokens=4),
            "no room for max_tokens": lambda: build_request(
                "Question: why?", cache, max_tokens=WINDOW
            ),
            "unknown policy": lambda: build_request("Question: why?", cache, recompute="lru"),
            "ratio over 1": lambda: build_request("Why?", cache, recompute_ratio=1.5),
            "negative ratio": lambda: build_request("Why?", cache, recompute_ratio=-0.1),
            "lone surrogate": lambda: build_request("Why \ud83d?", cache, max_tokens=2),
            "max_tokens 0": lambda: build_request("Why?", cache, max_tokens=0),
            "17 stop strings": lambda: build_request(
                "Why?", cache, max_tokens=2, stop=[f"s{i}" for i in range(17)]
            ),
            "stop string with a lone surrogate": lambda: build_request(
                "Why?", cache, max_tokens=2, stop=["half \ud83d"]
            ),
            "empty conversation id": lambda: GenerationRequest(
                [TextSegment("Why?")], conversation_id=""
            ),
            "malformed chunk id": lambda: GenerationRequest(
                [TextSegment("Q: "), ChunkSegment("doc 7", sentence(rng, 12))]
            ),
        }

    # -- sending --

    def send(self, request: GenerationRequest) -> str | None:
        """``request`` down both paths, streamed or whole; the answer, if there is one."""
        if self.rng.random() < 0.5:
            result = self.agree(lambda side: pieces_of(list(side.backend.stream(request))))
            answer = "".join(text for text, _ in result) if isinstance(result, list) else None
        else:
            result = self.agree(lambda side: whole(side.backend, request))
            answer = result[0] if isinstance(result, list) else None
        if answer is not None:
            self.last = (request, answer)
        return answer

    def agree(self, run: Callable[[Side], Any]) -> Any:
        """``run`` on the local and on the http backend: both give the same outcome."""
        local = outcome(lambda: run(self.paths.local))
        http = outcome(lambda: run(self.paths.http))
        assert http == local, f"step {len(self.kinds)}: {self.kinds[-1]}"
        return local


def whole(backend: Backend, request: GenerationRequest) -> list[Any]:
    text, stats = generate(backend, request)
    return [text, comparable(stats)]


def message_of(message: BaseMessage) -> dict[str, Any]:
    """What an AIMessage tells the app, but its id and the clock."""
    metadata = dict(message.response_metadata)
    if "chunkcache" in metadata:
        metadata["chunkcache"] = comparable(GenerationStats(**metadata["chunkcache"]))
    usage = getattr(message, "usage_metadata", None)
    return {"content": message.content, "usage": usage, "metadata": metadata}


def streamed_messages(chunks: Iterator[BaseMessage]) -> list[dict[str, Any]]:
    """The chunks of a streamed answer as they must agree: each one as it came."""
    return [message_of(chunk) for chunk in chunks]


@pytest.mark.slow
def test_local_and_http_agree_on_random_requests(paths: Paths) -> None:
    """Each step's outcome, local and over http, compared as it comes: a step that differs
    fails the test, which names the step (a conversation's later turns differ once its cache
    held other KV)."""
    rng = random.Random(SEED)
    chunks = [(f"doc-{i}", sentence(rng, rng.randint(8, 20))) for i in range(8)]
    for cid, text in chunks:
        paths.cache.registry.register(cid, text)
    probe = Probe(paths, rng, chunks)
    for _ in range(STEPS):
        probe.step()
    # The draw reached every kind of step.
    assert {kind.split(":")[0] for kind in probe.kinds} == {
        "templated",
        "chat",
        "segments",
        "stopped",
        "langchain",
        "edge",
    }


@pytest.mark.slow
def test_local_and_http_agree_on_every_edge(paths: Paths) -> None:
    """Each edge the random steps draw from, on both paths."""
    probe = Probe(paths, random.Random(SEED), chunks=[])
    for name, build in probe.edges().items():
        probe.kinds.append(f"edge: {name}")
        probe.agree(functools.partial(run_whole, build))


def run_whole(build: Callable[[], GenerationRequest], side: Side) -> list[Any]:
    return whole(side.backend, build())


# --- each difference the probe found, pinned on a fake backend ------------------------------


@pytest.fixture(scope="module")
def fake_served() -> Iterator[tuple[HttpBackend, FakeBackend]]:
    backend = FakeBackend()
    with serve_app(create_app(backend)) as url:
        http = HttpBackend(url)
        yield http, backend
        http.close()


A = "The river Seine flows through Paris and then into the English Channel."
B = "Mount Everest is the highest mountain above sea level, in the Himalayas."


@pytest.mark.parametrize(
    "segments",
    [
        # two texts under one id, as ``chunks=[(id, text), ...]`` may name them
        [TextSegment("Q: "), ChunkSegment("doc", A), TextSegment(" "), ChunkSegment("doc", B)],
        # the caller's own split: two texts side by side, each tokenized on its own
        [TextSegment(SYSTEM), TextSegment(" Context: "), ChunkSegment("a", A)],
        [TextSegment("Q: "), ChunkSegment("short", "Paris, France.")],  # too short to match
        [TextSegment(f"{A} "), ChunkSegment("a", A)],  # the chunk's text also as plain text
        [ChunkSegment("a", A), TextSegment(" "), ChunkSegment("b", A)],  # one text, two ids
        [TextSegment(""), ChunkSegment("a", A)],
    ],
    ids=["one-id-two-texts", "texts-side-by-side", "short-chunk", "also-text", "two-ids", "empty"],
)
def test_the_server_runs_the_segments_the_caller_split(
    fake_served: tuple[HttpBackend, FakeBackend], segments: list[Segment]
) -> None:
    """The server ran the caller's segments, not those its own matching of the prompt finds:
    each segment is tokenized on its own, and a chunk is a chunk, as the local backend runs
    it (it sent one text per chunk id, and split the prompt by finding those texts)."""
    http, backend = fake_served
    request = GenerationRequest(segments, sampling=SamplingParams(max_tokens=2))
    generate(http, request)
    assert backend.requests[-1].segments == segments


class Refusing(FakeBackend):
    """Refuses every request with ``error``, as a backend refuses input it cannot run."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def stream(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        EmptyPromptError("the prompt has no tokens"),
        InvalidTextError("the text is not valid Unicode"),
        InvalidConversationIdError("conversation id must be 1-256 characters"),
        PromptTooLongError("9 prompt tokens + 4 to generate exceed ..."),
    ],
)
def test_a_refusal_is_the_error_the_backend_raised(error: Exception) -> None:
    with serve_app(create_app(Refusing(error))) as url, pytest.raises(type(error)) as raised:
        generate(HttpBackend(url), GenerationRequest([TextSegment("Q?")]))
    assert str(raised.value) == f"{REFUSED}{error}"


@pytest.mark.parametrize(
    ("segments", "expected"),
    [
        ([TextSegment("")], EmptyPromptError),
        ([TextSegment("Q: "), ChunkSegment("a", f"{A} \ud83d")], InvalidTextError),
    ],
)
def test_a_prompt_no_body_can_carry_is_refused_as_the_local_backend_refuses_it(
    fake_served: tuple[HttpBackend, FakeBackend],
    segments: list[Segment],
    expected: type[Exception],
) -> None:
    """Not a ValueError from the server's schema, nor a UnicodeEncodeError from httpx."""
    http, backend = fake_served
    seen = len(backend.requests)
    with pytest.raises(expected):
        generate(http, GenerationRequest(segments))
    assert len(backend.requests) == seen  # refused before it was sent


def test_chat_messages_with_a_lone_surrogate_are_invalid_text(
    fake_served: tuple[HttpBackend, FakeBackend],
) -> None:
    with pytest.raises(InvalidTextError, match="ud83d at character 15"):
        fake_served[0].render_chat([{"role": "user", "content": "half an emoji: \ud83d"}])


@pytest.mark.parametrize(
    ("extension", "message"),
    [
        ({"segments": [{"text": "Q"}]}, "do not make up the prompt"),
        ({"segments": [{"text": "Q?"}], "chunks": [{"text": A}]}, "give one of them"),
        ({"segments": [{"text": "Q?", "chunk_id": "a b"}]}, "chunk id 'a b'"),
    ],
)
def test_given_segments_are_checked(
    fake_served: tuple[HttpBackend, FakeBackend], extension: dict[str, Any], message: str
) -> None:
    """The segments a client gives are the prompt's split, and their ids are store keys."""
    body = {"model": FakeBackend.model_name, "prompt": "Q?", "chunkcache": extension}
    response = httpx.post(f"{fake_served[0].base_url}/v1/completions", json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]

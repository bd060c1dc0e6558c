"""LlamaIndex integration: retriever, postprocessor and the multi-turn chat engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from llama_index.core.base.llms.types import (
    ChatMessage,
    CompletionResponse,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field
from llama_index.core.llms import CustomLLM
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode

from chunkcache.core import ChunkCache, chunk_id, default_cache
from chunkcache.core.chunk_ids import chunk_id_for
from chunkcache.core.ledger import ConversationLedger
from chunkcache.integrations.llama_index import ChunkCachePostprocessor, ChunkCacheRetriever
from chunkcache.integrations.llama_index_chat import CHUNK_IDS_KEY, ChunkCacheChatEngine

A, B, C, D, E = (
    "Alpha: json.dumps serializes an object to a JSON string.",
    "Bravo: json.loads parses a JSON string into Python objects.",
    "Charlie: pathlib.Path joins paths with the / operator.",
    "Delta: itertools.chain iterates over several iterables in turn.",
    "Echo: functools.lru_cache memoizes a function's results.",
)
KEYS = ("chunk_id", "retriever_rank", "seen_in_conversation")


class FixedRetriever(BaseRetriever):
    """Returns fresh nodes for the texts listed under each query, and keeps them."""

    def __init__(self, results: dict[str, list[str]]) -> None:
        super().__init__()
        self.results = results
        self.returned: list[NodeWithScore] = []

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        texts = self.results[query_bundle.query_str]
        self.returned = [
            NodeWithScore(
                node=TextNode(text=text, metadata={"source": f"doc-{i}"}), score=1 - i / 10
            )
            for i, text in enumerate(texts)
        ]
        return self.returned


def chatml(messages: Sequence[ChatMessage]) -> str:
    turns = "".join(f"<|im_start|>{m.role.value}\n{m.content}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


class RecordingLLM(CustomLLM):
    """Records every rendered prompt; answers "Answer <n>." (streamed word by word)."""

    prompts: list[str] = Field(default_factory=list)
    fail_next: bool = False

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata()

    def _answer(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("model unavailable")
        return f"Answer {len(self.prompts)}."

    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return CompletionResponse(text=self._answer(prompt))

    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        words = self._answer(prompt).split(" ")

        def gen() -> CompletionResponseGen:
            for i, word in enumerate(words):
                delta = word if i == 0 else " " + word
                yield CompletionResponse(text=" ".join(words[: i + 1]), delta=delta)

        return gen()


def texts(nodes: list[NodeWithScore]) -> list[str]:
    return [n.node.get_content() for n in nodes]


def make_retriever(results: dict[str, list[str]], **kwargs: Any) -> ChunkCacheRetriever:
    return ChunkCacheRetriever(FixedRetriever(results), cache=ChunkCache(), **kwargs)


# --- retriever -------------------------------------------------------------------------


def test_nodes_carry_chunk_metadata_and_keep_their_ids() -> None:
    retriever = make_retriever({"q": [A, B]}, ordering="retriever")
    nodes = retriever.retrieve("q")
    fixed = retriever.base_retriever
    assert isinstance(fixed, FixedRetriever)
    base_nodes = fixed.returned
    assert texts(nodes) == [A, B]
    for rank, (node, base) in enumerate(zip(nodes, base_nodes, strict=True)):
        assert node.node.metadata == {
            "source": base.node.metadata["source"],
            "chunk_id": chunk_id(base.node.get_content()),
            "retriever_rank": rank,
            "seen_in_conversation": False,
        }
        assert node.node.node_id == base.node.node_id
        assert node.score == base.score


def test_base_nodes_are_not_mutated() -> None:
    retriever = make_retriever({"q": [A, B]})
    retriever.retrieve("q")
    fixed = retriever.base_retriever
    assert isinstance(fixed, FixedRetriever)
    for base in fixed.returned:
        assert set(base.node.metadata) == {"source"}
        assert base.node.excluded_llm_metadata_keys == []
        assert base.node.excluded_embed_metadata_keys == []


def test_chunk_id_is_stable_and_a_metadata_chunk_id_scopes_it() -> None:
    class Preassigned(FixedRetriever):
        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            nodes = super()._retrieve(query_bundle)
            nodes[0].node.metadata["chunk_id"] = "my-chunk-1"
            return nodes

    first = make_retriever({"q": [A, B]}).retrieve("q")
    second = make_retriever({"q": [A, B]}).retrieve("q")
    assert [n.node.metadata["chunk_id"] for n in first] == [
        n.node.metadata["chunk_id"] for n in second
    ]
    preassigned = ChunkCacheRetriever(Preassigned({"q": [A, B]}), cache=ChunkCache())
    ids = {n.node.get_content(): n.node.metadata["chunk_id"] for n in preassigned.retrieve("q")}
    assert ids == {A: chunk_id_for(A, {"chunk_id": "my-chunk-1"}), B: chunk_id(B)}


def test_retriever_rank_is_the_base_rank_whatever_the_order() -> None:
    retriever = make_retriever({"warm": [C], "q": [A, B, C]}, ordering="frequency")
    retriever.retrieve("warm")
    nodes = retriever.retrieve("q")
    assert texts(nodes)[0] == C
    assert {n.node.get_content(): n.node.metadata["retriever_rank"] for n in nodes} == {
        A: 0,
        B: 1,
        C: 2,
    }


def test_nodes_with_the_same_text_collapse_to_the_best_ranked() -> None:
    nodes = make_retriever({"q": [A, B, A, " "]}, ordering="retriever").retrieve("q")
    # the blank node's metadata ("source: doc-3") is what LlamaIndex would send: kept, last
    assert texts(nodes) == [A, B, " "]
    assert nodes[0].score == 1.0
    assert [n.node.metadata["retriever_rank"] for n in nodes[:2]] == [0, 1]
    assert "chunk_id" not in nodes[2].node.metadata


def test_excluded_keys_stay_out_of_llm_and_embed_text() -> None:
    node = make_retriever({"q": [A]}).retrieve("q")[0].node
    for mode in (MetadataMode.LLM, MetadataMode.EMBED):
        content = node.get_content(metadata_mode=mode)
        assert content == f"source: doc-0\n\n{A}"
        assert not any(key in content for key in KEYS)


@pytest.mark.parametrize(
    ("dedupe", "second_turn", "seen"),
    [("drop", [C], None), ("mark", [B, C], [True, False]), ("off", [B, C], None)],
)
def test_dedupe_modes_within_one_conversation(
    dedupe: str, second_turn: list[str], seen: list[bool] | None
) -> None:
    retriever = make_retriever(
        {"q1": [A, B], "q2": [B, C]}, ordering="retriever", dedupe=dedupe
    ).for_conversation("conv-1")
    assert texts(retriever.retrieve("q1")) == [A, B]
    nodes = retriever.retrieve("q2")
    assert texts(nodes) == second_turn
    if seen is None:
        assert all("seen_in_conversation" not in n.node.metadata for n in nodes)
    else:
        assert [n.node.metadata["seen_in_conversation"] for n in nodes] == seen


def test_dedupe_is_per_conversation() -> None:
    retriever = make_retriever({"q": [A, B]}, dedupe="drop")
    assert len(retriever.for_conversation("conv-1").retrieve("q")) == 2
    assert len(retriever.for_conversation("conv-2").retrieve("q")) == 2
    assert len(retriever.retrieve("q")) == 2  # no conversation: nothing deduped
    assert retriever.for_conversation("conv-1").retrieve("q") == []


def test_for_conversation_shares_the_cache_and_base() -> None:
    retriever = make_retriever({"q": [A]}, dedupe="drop", conversation_id="conv-1")
    bound = retriever.for_conversation("conv-2")
    assert bound.cache is retriever.cache
    assert bound.base_retriever is retriever.base_retriever
    assert (bound.conversation_id, retriever.conversation_id) == ("conv-2", "conv-1")
    bound.retrieve("q")
    assert retriever.cache.ledger.seen("conv-2") == {chunk_id(A)}
    assert chunk_id(A) in retriever.cache.access_table


def test_frequency_ordering_puts_frequent_chunks_first() -> None:
    retriever = make_retriever({"q1": [A, B], "q2": [C, B], "q3": [D, C, B]}, ordering="frequency")
    retriever.retrieve("q1")
    assert texts(retriever.retrieve("q2")) == [B, C]
    assert texts(retriever.retrieve("q3")) == [B, C, D]


def test_constructor_validates_names_and_defaults_to_the_shared_cache() -> None:
    base = FixedRetriever({})
    with pytest.raises(ValueError, match="ordering"):
        ChunkCacheRetriever(base, ordering="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dedupe"):
        ChunkCacheRetriever(base, dedupe="skip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="conversation id"):
        ChunkCacheRetriever(base, conversation_id="")
    assert ChunkCacheRetriever(base).cache is default_cache()


async def test_async_retrieve_matches_sync() -> None:
    results = {"q1": [A, B], "q2": [B, C]}
    sync = make_retriever(results, dedupe="drop", conversation_id="c")
    asynchronous = make_retriever(results, dedupe="drop", conversation_id="c")
    for query in results:
        expected = sync.retrieve(query)
        got = await asynchronous.aretrieve(query)
        assert [n.node.metadata for n in got] == [n.node.metadata for n in expected]


# --- postprocessor ---------------------------------------------------------------------


async def test_postprocessor_matches_the_retriever() -> None:
    results = {"q1": [A, B, A], "q2": [C, B], "q3": [B, D, C]}
    retriever = make_retriever(results, ordering="frequency", conversation_id="c")
    base = FixedRetriever(results)
    postprocessor = ChunkCachePostprocessor(
        cache=ChunkCache(), ordering="frequency", conversation_id="c"
    )
    for query in results:
        expected = retriever.retrieve(query)
        got = postprocessor.postprocess_nodes(base.retrieve(query), query_str=query)
        assert [(n.node.metadata, n.score) for n in got] == [
            (n.node.metadata, n.score) for n in expected
        ]
    again = await postprocessor.for_conversation("c").apostprocess_nodes(base.retrieve("q1"))
    assert [n.node.metadata["seen_in_conversation"] for n in again] == [True, True]


def test_postprocessor_fields_and_for_conversation() -> None:
    # The field is a ChunkCache; None is turned into the default by its "before" validator.
    postprocessor = ChunkCachePostprocessor(cache=None, dedupe="drop")  # type: ignore[arg-type]
    assert postprocessor.cache is default_cache()
    bound = postprocessor.for_conversation("conv-9")
    assert (bound.conversation_id, bound.cache, bound.dedupe) == ("conv-9", default_cache(), "drop")
    assert postprocessor.conversation_id is None
    with pytest.raises(ValueError):
        ChunkCachePostprocessor(ordering="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ChunkCachePostprocessor(conversation_id="")


# --- chat engine -----------------------------------------------------------------------

TURNS = {"q1": [A, B, C], "q2": [B, C, D], "q3": [D, A, E], "q4": [A, B]}


def make_engine(
    results: dict[str, list[str]] = TURNS, *, cache: ChunkCache | None = None, **kwargs: Any
) -> ChunkCacheChatEngine:
    return ChunkCacheChatEngine.from_defaults(
        FixedRetriever(results),
        RecordingLLM(messages_to_prompt=chatml),
        system_prompt="Answer from the context.",
        cache=cache or ChunkCache(),
        conversation_id="chat-1",
        **kwargs,
    )


def recording_llm(engine: ChunkCacheChatEngine) -> RecordingLLM:
    llm = engine._llm
    assert isinstance(llm, RecordingLLM)
    return llm


def prompts(engine: ChunkCacheChatEngine) -> list[str]:
    return recording_llm(engine).prompts


def assert_each_prompt_extends_the_last(engine: ChunkCacheChatEngine) -> None:
    history = engine.chat_history
    answers = [m.content for m in history if m.role == MessageRole.ASSISTANT]
    sent = prompts(engine)
    for t in range(1, len(sent)):
        expected = sent[t - 1] + f"{answers[t - 1]}<|im_end|>\n<|im_start|>user\n"
        assert sent[t].startswith(expected)
        new_user = sent[t][len(expected) :]
        assert new_user == f"{history[2 * t].content}<|im_end|>\n<|im_start|>assistant\n"


def test_each_prompt_extends_the_previous_and_holds_each_chunk_once() -> None:
    engine = make_engine()
    sources = [engine.chat(q).source_nodes for q in ("q1", "q2", "q3", "q4")]
    assert [texts(s) for s in sources[1:]] == [[D], [E], []]
    assert prompts(engine)[0].startswith("<|im_start|>system\nAnswer from the context.<|im_end|>")
    assert_each_prompt_extends_the_last(engine)
    final = prompts(engine)[-1]
    assert all(final.count(text) == 1 for text in (A, B, C, D, E))
    assert engine.chat_history[-2].content == "q4"  # no new chunks: the question alone
    assert "chunk_id" not in final and "retriever_rank" not in final
    assert len(engine.chat_history) == 8


def test_streaming_and_async_turns_keep_the_layout() -> None:
    engine = make_engine()
    streamed = engine.stream_chat("q1")
    assert "".join(streamed.response_gen) == "Answer 1."
    assert engine.chat("q2").response == "Answer 2."
    assert_each_prompt_extends_the_last(engine)


async def test_async_and_async_streaming_turns() -> None:
    engine = make_engine()
    assert (await engine.achat("q1")).response == "Answer 1."
    streamed = await engine.astream_chat("q2")
    assert "".join([token async for token in streamed.async_response_gen()]) == "Answer 2."
    assert texts((await engine.achat("q3")).source_nodes) == [E]
    assert_each_prompt_extends_the_last(engine)


def test_reset_forgets_history_and_ledger() -> None:
    engine = make_engine()
    engine.chat("q1")
    ledger = engine._retriever.cache.ledger
    assert ledger.seen("chat-1") == {chunk_id(t) for t in (A, B, C)}
    engine.reset()
    assert engine.chat_history == []
    assert "chat-1" not in ledger
    assert sorted(texts(engine.chat("q1").source_nodes)) == [A, B, C]


def test_trimming_history_resyncs_the_ledger() -> None:
    engine = make_engine({"q1": [A, B], "q2": [C], "q3": [D], "q4": [A, D]}, max_history_turns=2)
    for query in ("q1", "q2", "q3"):
        engine.chat(query)
    assert [m.content for m in engine.chat_history][1] == "Answer 3."  # only turn 3 kept
    assert engine._retriever.cache.ledger.seen("chat-1") == {chunk_id(D)}
    assert texts(engine.chat("q4").source_nodes) == [A]  # A left the prompt, so it is resent


def test_a_failed_turn_does_not_leave_its_chunks_marked_seen() -> None:
    engine = make_engine()
    recording_llm(engine).fail_next = True
    with pytest.raises(RuntimeError):
        engine.chat("q1")
    assert engine.chat_history == []
    assert sorted(texts(engine.chat("q1").source_nodes)) == [A, B, C]


def test_given_chat_history_replaces_history_and_ledger() -> None:
    engine = make_engine()
    engine.chat("q1")
    given = [
        ChatMessage(role=MessageRole.USER, content="Hi"),
        ChatMessage(role=MessageRole.ASSISTANT, content="Hello"),
    ]
    assert sorted(texts(engine.chat("q1", chat_history=given).source_nodes)) == [A, B, C]
    assert engine.chat_history[:2] == given


def test_a_given_history_whose_message_was_edited_gives_back_the_chunks_it_lost() -> None:
    engine = make_engine()
    engine.chat("q1")
    first, *rest = engine.chat_history
    assert B in (first.content or "")
    # The app cut B out of the stored turn but kept its recorded chunk ids.
    edited = first.model_copy()
    edited.content = (first.content or "").replace(B, "")
    assert edited.additional_kwargs[CHUNK_IDS_KEY] == first.additional_kwargs[CHUNK_IDS_KEY]
    assert texts(engine.chat("q2", chat_history=[edited, *rest]).source_nodes) == [B, D]


@pytest.mark.parametrize("lost", ["evicted", "expired"])
def test_a_ledger_entry_lost_to_its_bounds_is_rebuilt_from_the_history(lost: str) -> None:
    now = [0.0]
    ledger = ConversationLedger(max_conversations=1, ttl_s=10, clock=lambda: now[0])
    engine = make_engine(cache=ChunkCache(ledger=ledger))
    engine.chat("q1")
    if lost == "evicted":
        ledger.record("chat-2", [chunk_id(E)])  # another conversation takes the only slot
    else:
        now[0] = 11.0  # the chat resumes after the ledger's TTL
    assert "chat-1" not in ledger
    assert texts(engine.chat("q2").source_nodes) == [D]
    final = prompts(engine)[-1]
    assert all(final.count(text) == 1 for text in (A, B, C, D))
    assert_each_prompt_extends_the_last(engine)


def test_a_history_passed_back_keeps_its_chunks() -> None:
    engine = make_engine()
    engine.chat("q1")
    # As an app would store it, then load it for the next turn.
    saved = [ChatMessage.model_validate_json(m.model_dump_json()) for m in engine.chat_history]
    assert set(saved[0].additional_kwargs[CHUNK_IDS_KEY]) == {chunk_id(t) for t in (A, B, C)}
    assert texts(engine.chat("q2", chat_history=saved).source_nodes) == [D]
    resumed = make_engine()  # another engine, with an empty ledger
    sent_kwargs: list[dict[str, Any]] = []

    def render(messages: Sequence[ChatMessage]) -> str:
        sent_kwargs.extend(m.additional_kwargs for m in messages)
        return chatml(messages)

    recording_llm(resumed).messages_to_prompt = render
    assert texts(resumed.chat("q3", chat_history=engine.chat_history).source_nodes) == [E]
    final = prompts(resumed)[-1]
    assert all(final.count(text) == 1 for text in (A, B, C, D, E))
    assert not any(CHUNK_IDS_KEY in kwargs for kwargs in sent_kwargs)  # kept from the LLM


def test_max_history_turns_trims_a_given_history() -> None:
    earlier = make_engine()
    for query in ("q1", "q2", "q3"):  # turns holding A, B, C | D | E
        earlier.chat(query)
    engine = make_engine(max_history_turns=2)
    nodes = engine.chat("q4", chat_history=earlier.chat_history).source_nodes
    assert sorted(texts(nodes)) == [A, B]  # only turn 3 (E) is kept, so A and B are resent
    final = prompts(engine)[-1]
    assert final.count("<|im_start|>user") == 2
    assert [final.count(text) for text in (A, B, C, D, E)] == [1, 1, 0, 0, 1]
    assert [m.content for m in engine.chat_history][1] == "Answer 3."


def test_engine_arguments_are_checked() -> None:
    llm = RecordingLLM()
    unbound = ChunkCacheRetriever(FixedRetriever({}), cache=ChunkCache())
    with pytest.raises(ValueError, match="conversation"):
        ChunkCacheChatEngine(unbound, llm)
    with pytest.raises(TypeError):
        ChunkCacheChatEngine.from_defaults(unbound, llm)
    with pytest.raises(ValueError, match="context_template"):
        ChunkCacheChatEngine.from_defaults(FixedRetriever({}), llm, context_template="{ctx}")
    engine = ChunkCacheChatEngine.from_defaults(FixedRetriever({}), llm)
    assert len(engine.conversation_id) == 32
    assert engine._retriever.dedupe == "drop"


# --- bundled corpus --------------------------------------------------------------------


@pytest.mark.slow  # embeds the corpus on first use (minutes), loads MiniLM (~15 s) after
def test_bundled_corpus_retriever_in_a_chat() -> None:
    indexes = pytest.importorskip(
        "chunkcache.integrations.indexes", reason="bundled-corpus indexes not available"
    )
    if not hasattr(indexes, "llama_index_corpus_retriever"):
        pytest.skip("chunkcache.integrations.indexes has no llama_index_corpus_retriever yet")
    base = indexes.llama_index_corpus_retriever("faiss", similarity_top_k=3)
    engine = ChunkCacheChatEngine.from_defaults(
        base, RecordingLLM(messages_to_prompt=chatml), cache=ChunkCache()
    )
    questions = ("How do I serialize an object to JSON?", "How do I turn an object into JSON?")
    first, second = (engine.chat(q).source_nodes for q in questions)
    first_ids = {n.node.metadata["chunk_id"] for n in first}
    second_ids = {n.node.metadata["chunk_id"] for n in second}
    assert len(first) == 3
    assert all(n.node.node_id == n.node.metadata["chunk_id"] for n in first)
    assert first_ids & {n.node.node_id for n in base.retrieve(questions[1])}  # overlap...
    assert first_ids.isdisjoint(second_ids)  # ...that the second turn drops
    assert_each_prompt_extends_the_last(engine)

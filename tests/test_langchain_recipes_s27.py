"""LangChain RAG recipes as users write them in 2026, on the real retriever wrapper over a real
vector store and the engine on a tiny random model: ``create_retrieval_chain`` with
``create_stuff_documents_chain``, and ``create_history_aware_retriever``, whose rephrasing
call and answer call share the conversation.  The helpers here serve the other
``test_langchain_recipes_s27_*`` files too."""

from __future__ import annotations

import itertools
import re
import warnings
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.embeddings import Embeddings
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables import RunnableConfig
from langchain_core.vectorstores import InMemoryVectorStore

from chunkcache.core import ChunkCache
from chunkcache.core.engine import ChunkEngine
from chunkcache.core.escaped_chunks import EscapedChunksWarning
from chunkcache.core.generation import GenerationRequest
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.model_files import pull_default_model
from chunkcache.core.models import LoadedModel
from chunkcache.integrations.langchain import ChunkCacheLLM, ChunkCacheRetriever

classic_chains = pytest.importorskip("langchain_classic.chains")
combine_documents = pytest.importorskip("langchain_classic.chains.combine_documents")

FACTS = [
    f"Fact {i}: the value of item {i} is {i * 7}, and it is kept in drawer {i % 3}."
    for i in range(12)
]


class ItemEmbeddings(Embeddings):
    """A text's vector marks the item numbers it names ("item 3"), so a question naming two
    items finds exactly their facts first."""

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self.embed_query(text) for text in texts]

    def embed_query(self, text: str) -> list[float]:
        named = {int(number) for number in re.findall(r"item (\d+)", text)}
        return [float(i in named) for i in range(len(FACTS))] + [0.1]


def fact_store(facts: list[str] = FACTS) -> InMemoryVectorStore:
    return InMemoryVectorStore.from_texts(facts, ItemEmbeddings())


def tiny_smollm2() -> LoadedModel:
    """A tiny random model with SmolLM2's tokenizer and chat template."""
    from tiny_models import tiny_hf_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pull_default_model())
    return LoadedModel.from_hf(tiny_hf_model(vocab_size=len(tokenizer)), tokenizer)


class RecordingBackend(LocalBackend):
    """The local backend, recording every request it is sent."""

    def __init__(self, engine: ChunkEngine) -> None:
        super().__init__(engine)
        self.requests: list[GenerationRequest] = []

    def stream(self, request: GenerationRequest) -> Any:
        self.requests.append(request)
        return super().stream(request)

    def sent(self) -> list[tuple[str | None, str]]:
        """Each request's conversation id and prompt text."""
        return [
            (r.conversation_id, "".join(segment.text for segment in r.segments))
            for r in self.requests
        ]


def engine_cache(lm: LoadedModel) -> ChunkCache:
    """A fresh cache (registry, ledger, store) on the engine over ``lm``."""
    return ChunkCache(backend=RecordingBackend(ChunkEngine(lm)))


@dataclass
class LLMRun:
    """One chat model run: the messages it was given and the message it answered."""

    prompt: list[BaseMessage]
    answer: AIMessage

    @property
    def stats(self) -> dict[str, Any]:
        return dict(self.answer.response_metadata["chunkcache"])

    @property
    def text(self) -> str:
        return "".join(str(message.content) for message in self.prompt)


class Runs(BaseCallbackHandler):
    """The chat model runs (in the order they ended) and ChunkCacheRetriever queries of
    every call made with this handler in its config."""

    def __init__(self) -> None:
        self.prompts: dict[UUID, list[BaseMessage]] = {}
        self.llm: list[LLMRun] = []
        self.queries: list[str] = []

    def on_chat_model_start(
        self,
        serialized: dict[str, Any],
        messages: list[list[BaseMessage]],
        *,
        run_id: UUID,
        **kwargs: Any,
    ) -> None:
        self.prompts[run_id] = messages[0]

    def on_llm_end(self, response: LLMResult, *, run_id: UUID, **kwargs: Any) -> None:
        generation = response.generations[0][0]
        assert isinstance(generation, ChatGeneration)
        assert isinstance(generation.message, AIMessage)
        self.llm.append(LLMRun(self.prompts[run_id], generation.message))

    def on_retriever_start(
        self, serialized: dict[str, Any], query: str, *, run_id: UUID, **kwargs: Any
    ) -> None:
        if kwargs.get("name") == "ChunkCacheRetriever":
            self.queries.append(query)


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return tiny_smollm2()


def session(key: str, runs: Runs) -> RunnableConfig:
    return RunnableConfig(configurable={"session_id": key}, callbacks=[runs])


def retrieval_chain(cache: ChunkCache) -> Any:
    """``create_retrieval_chain`` over ``create_stuff_documents_chain``, two facts a question."""
    retriever = ChunkCacheRetriever(
        base_retriever=fact_store().as_retriever(search_kwargs={"k": 2}), cache=cache
    )
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from the context.\n\n{context}"), ("human", "{input}")]
    )
    llm = ChunkCacheLLM(chunk_cache=cache, max_tokens=4)
    return classic_chains.create_retrieval_chain(
        retriever, combine_documents.create_stuff_documents_chain(llm, prompt)
    )


def test_create_retrieval_chain_finds_the_stuffed_chunks_and_reuses_them(lm: LoadedModel) -> None:
    cache = engine_cache(lm)
    chain = retrieval_chain(cache)
    runs = Runs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", EscapedChunksWarning)
        first = chain.invoke({"input": "item 3 and item 4?"}, config=session("a", runs))
        second = chain.invoke({"input": "item 4 and item 5?"}, config=session("b", runs))
    assert [doc.page_content for doc in first["context"]] == [FACTS[3], FACTS[4]]
    assert isinstance(first["answer"], str)
    found = [run.stats for run in runs.llm]
    assert [(s["chunk_hits"], s["chunk_misses"]) for s in found] == [(0, 2), (1, 1)]
    assert {doc.page_content for doc in second["context"]} == {FACTS[4], FACTS[5]}
    usage = runs.llm[1].answer.usage_metadata
    assert usage is not None and usage["input_token_details"]["cache_read"] > 0


def test_a_follow_up_reuses_a_stored_chunk_that_starts_like_the_last_turns(
    lm: LoadedModel,
) -> None:
    """The conversation's last prompt shares a next chunk's first tokens ("Fact "): the
    exact prefix taken from it stops at that chunk, which is placed from the store whole
    (it had been computed anew: a chunk the prefix covers in part cannot be placed)."""
    cache = engine_cache(lm)
    chain = retrieval_chain(cache)
    runs = Runs()
    chain.invoke({"input": "item 3 and item 4?"}, config=session("a", runs))
    chain.invoke({"input": "item 4 and item 5?"}, config=session("b", runs))  # stores fact 5
    follow_up = chain.invoke({"input": "item 5 and item 6?"}, config=session("a", runs))
    assert follow_up["context"][0].page_content == FACTS[5]
    assert runs.llm[-1].stats["chunk_hits"] == 1


def history_aware_chain(cache: ChunkCache, rephraser: ChunkCacheLLM) -> Any:
    """``create_retrieval_chain`` over ``create_history_aware_retriever``, as LangChain's
    conversational RAG tutorial builds it, over a knowledge base of three facts."""
    retriever = ChunkCacheRetriever(
        base_retriever=fact_store(FACTS[:3]).as_retriever(search_kwargs={"k": 3}), cache=cache
    )
    rephrase = ChatPromptTemplate.from_messages(
        [
            (
                "system",
                "Given the chat history and the latest user question, write a "
                "standalone question. Do NOT answer it.",
            ),
            MessagesPlaceholder("chat_history"),
            ("human", "{input}"),
        ]
    )
    answer = ChatPromptTemplate.from_messages(
        [
            ("system", "Answer from the context.\n\n{context}"),
            MessagesPlaceholder("chat_history"),
            ("human", "{input}"),
        ]
    )
    llm = ChunkCacheLLM(chunk_cache=cache, max_tokens=4)
    return classic_chains.create_retrieval_chain(
        classic_chains.create_history_aware_retriever(rephraser, retriever, rephrase),
        combine_documents.create_stuff_documents_chain(llm, answer),
    )


def test_a_rephrasing_call_and_the_answer_each_reuse_their_own_last_prompt(
    lm: LoadedModel,
) -> None:
    """Two LLM calls per turn in one conversation: the engine keeps a sequence per prompt
    shape, so each call's next-turn prompt starts with its own last prompt, and all of it is
    reused (with one sequence per conversation, each call replaced the other's and reused
    only the template's first tokens)."""
    cache = engine_cache(lm)
    rephraser = ChunkCacheLLM(chunk_cache=cache, max_tokens=6)
    chain = history_aware_chain(cache, rephraser)
    runs = Runs()
    history: list[BaseMessage] = []
    contexts = []
    for question in ("What is in item 1?", "And item 2?", "And item 0?"):
        config = session("user-42", runs)
        result = chain.invoke({"input": question, "chat_history": history}, config=config)
        history += [HumanMessage(question), AIMessage(result["answer"])]
        contexts.append(result["context"])
    rephrased = [run for run in runs.llm if "standalone" in run.text]
    answers = [run for run in runs.llm if "standalone" not in run.text]
    assert (len(rephrased), len(answers)) == (2, 3)  # no rephrasing without a history
    # The retriever is asked the rephrased question, in the conversation.
    assert runs.queries[1:] == [str(run.answer.content) for run in rephrased]
    assert all(doc.metadata["seen_in_conversation"] for docs in contexts[1:] for doc in docs)
    before, after = rephrased
    assert after.stats["reused_tokens"] >= before.stats["prompt_tokens"]
    for before, after in itertools.pairwise(answers):
        assert after.stats["reused_tokens"] >= before.stats["prompt_tokens"]

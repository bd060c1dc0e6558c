"""LlamaIndex packs retrieved text up to the context window counting tokens with its own
tokenizer (tiktoken); ``ChunkCacheLLM.prompt_helper()`` makes a query engine count as the
model does, so a prompt packed full still fits.  SmolLM2's tokenizer splits numbers into
single digits, tiktoken does not: number-heavy text is where the two counts part.

The fast tests run a tiny random model under SmolLM2's real tokenizer and chat template
(counting needs nothing else); the slow one runs SmolLM2 itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
from engine_support import RecordingEngine
from llama_index.core import get_response_synthesizer
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import ResponseMode
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from tiny_models import tiny_hf_model

from chunkcache.core.cache import ChunkCache
from chunkcache.core.errors import PromptTooLongError
from chunkcache.core.local_backend import LocalBackend
from chunkcache.core.model_files import pull_default_model
from chunkcache.core.models import LoadedModel
from chunkcache.integrations.llama_index import ChunkCacheLLM, ChunkCacheRetriever

WINDOW = 1024
MAX_TOKENS = 16
QUESTION = "How many units shipped in 2024?"
TREE = ResponseMode.TREE_SUMMARIZE  # packs every prompt to the window (5 tokens of padding)


def records(num_nodes: int, per_node: int) -> list[str]:
    """Shipping records: dates, amounts and ids, ``per_node`` to a node."""
    return [
        " ".join(
            f"Record {i}.{j}: order 2024-{i:04d}-{j} shipped 1{i}7,{j}31 units at "
            f"${j}{i}.{i}9 on 20{i % 30:02d}-0{j % 9 + 1}-1{i % 9}."
            for j in range(per_node)
        )
        for i in range(num_nodes)
    ]


class Records(BaseRetriever):
    """Returns every text, whatever the query."""

    def __init__(self, texts: Sequence[str]) -> None:
        super().__init__()
        self._texts = texts

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [NodeWithScore(node=TextNode(text=t), score=1.0) for t in self._texts]


@pytest.fixture(scope="module")
def tiny_smollm2() -> LoadedModel:
    """A tiny random model with SmolLM2's tokenizer (and chat template) and a 1k window."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pull_default_model())
    hf = tiny_hf_model(vocab_size=len(tokenizer), max_position_embeddings=WINDOW)
    return LoadedModel.from_hf(hf, tokenizer)


def query(llm: ChunkCacheLLM, texts: Sequence[str], mode: ResponseMode, **synthesizer: Any) -> str:
    """The answer of a query engine in response mode ``mode`` over ``texts``."""
    retriever = ChunkCacheRetriever(Records(texts), cache=llm.cache)
    synth = get_response_synthesizer(llm=llm, response_mode=mode, **synthesizer)
    engine = RetrieverQueryEngine.from_args(retriever, llm=llm, response_synthesizer=synth)
    return str(engine.query(QUESTION))


def counting_llm(lm: LoadedModel, **settings: Any) -> tuple[ChunkCacheLLM, RecordingEngine]:
    engine = RecordingEngine(lm)
    llm = ChunkCacheLLM(cache=ChunkCache(backend=LocalBackend(engine)), **settings)
    return llm, engine


@pytest.mark.parametrize("system_prompt", [None, "You audit shipping records; cite record ids."])
def test_a_prompt_packed_to_the_window_fits(
    tiny_smollm2: LoadedModel, system_prompt: str | None
) -> None:
    llm, engine = counting_llm(tiny_smollm2, max_tokens=MAX_TOKENS, system_prompt=system_prompt)
    query(llm, records(12, 6), TREE, prompt_helper=llm.prompt_helper())
    assert len(engine.calls) > 2  # several packed prompts, then their summary
    assert WINDOW - MAX_TOKENS - 64 < largest_prompt(engine) <= WINDOW - MAX_TOKENS


def test_counting_with_tiktoken_overfills_and_the_refusal_says_what_to_do(
    tiny_smollm2: LoadedModel,
) -> None:
    llm, engine = counting_llm(tiny_smollm2, max_tokens=MAX_TOKENS)
    with pytest.raises(PromptTooLongError, match=r"prompt_helper=llm\.prompt_helper\(\)"):
        query(llm, records(12, 6), TREE)  # LlamaIndex's own PromptHelper
    assert largest_prompt(engine) > WINDOW


@pytest.mark.slow
def test_on_smollm2_a_prompt_packed_to_the_window_is_answered() -> None:
    """SmolLM2 itself, its window cut to ``WINDOW`` (filling its 8k window took minutes)."""
    lm = LocalBackend.default().engine.lm
    spec = dataclasses.replace(lm.spec, max_positions=WINDOW)
    llm, engine = counting_llm(
        LoadedModel(lm.hf, lm.tokenizer, spec, lm.rope, lm.fingerprint), max_tokens=MAX_TOKENS
    )
    answer = query(llm, records(12, 6), TREE, prompt_helper=llm.prompt_helper())
    assert answer.strip() and len(engine.calls) > 2
    assert WINDOW - MAX_TOKENS - 64 < largest_prompt(engine) <= WINDOW - MAX_TOKENS


def largest_prompt(engine: RecordingEngine) -> int:
    """The most tokens any prompt the engine was asked to prefill had (refused ones too)."""
    return max(call.tokens for call in engine.calls)

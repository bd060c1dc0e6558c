"""langchain-tests' standard retriever suite, over a real Chroma index of the bundled corpus."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_tests.integration_tests import RetrieversIntegrationTests

from chunkcache.core import ChunkCache
from chunkcache.integrations.indexes import langchain_corpus_retriever
from chunkcache.integrations.langchain import ChunkCacheRetriever


@pytest.fixture(scope="module")
def chroma_retriever() -> Any:
    return langchain_corpus_retriever("chroma", k=4)


class TestChunkCacheRetrieverOverChroma(RetrieversIntegrationTests):
    @pytest.fixture(autouse=True)
    def _base(self, chroma_retriever: Any) -> None:
        self._base_retriever = chroma_retriever

    @property
    def retriever_constructor(self) -> type[ChunkCacheRetriever]:
        return ChunkCacheRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"base_retriever": self._base_retriever, "cache": ChunkCache(), "k": 4}

    @property
    def retriever_query_example(self) -> str:
        return "How do I serialize a Python object to JSON?"

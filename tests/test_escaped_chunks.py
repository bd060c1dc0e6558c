"""A prompt holding the retrieved chunks only escaped gets a warning with the fix."""

from __future__ import annotations

import html
import json
import warnings
from collections.abc import Callable

import pytest
from fake_backend import FakeBackend
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnablePassthrough

from chunkcache.core import ChunkCache
from chunkcache.core.escaped_chunks import EscapedChunksWarning
from chunkcache.core.prompting import build_request
from chunkcache.core.segmenter import ChunkSegment
from chunkcache.integrations.langchain import ChunkCacheLLM, ChunkCacheRetriever

CHUNK = 'json.dumps(obj) writes "obj" as JSON.\nIt raises TypeError for a set & <tag>; café ☕.'


def _cache() -> ChunkCache:
    cache = ChunkCache(backend=FakeBackend())
    cache.registry.register("c1", CHUNK)
    return cache


@pytest.mark.parametrize(
    "escape",
    [repr, json.dumps, lambda text: json.dumps(text, ensure_ascii=False), html.escape],
    ids=["repr", "json-ascii", "json", "html"],
)
def test_a_chunk_only_in_escaped_form_warns(escape: Callable[[str], str]) -> None:
    prompt = f"Context: {escape(CHUNK)}\nQuestion: what does it raise?"
    with pytest.warns(EscapedChunksWarning, match="page_content"):
        request = build_request(prompt, _cache())
    assert not any(isinstance(s, ChunkSegment) for s in request.segments)
    assert "".join(s.text for s in request.segments) == prompt  # the prompt is not changed


@pytest.mark.parametrize(
    "prompt",
    [f"Context: {CHUNK}\nQuestion?", "A chat with no retrieved text in it at all.", ""],
    ids=["found as written", "no chunk", "empty"],
)
def test_no_warning_when_the_chunks_are_found_or_absent(prompt: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_request(prompt, _cache())


def test_no_warning_before_any_chunk_is_registered() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_request(f"Context: {CHUNK!r}", ChunkCache(backend=FakeBackend()))


class _OneDocument(BaseRetriever):
    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return [Document(page_content=CHUNK)]


def test_a_langchain_chain_given_the_document_list_warns_and_the_join_does_not() -> None:
    cache = ChunkCache(backend=FakeBackend())
    retriever = ChunkCacheRetriever(base_retriever=_OneDocument(), cache=cache)
    prompt = ChatPromptTemplate.from_messages([("human", "{context}\n\nQ: {question}")])
    llm = ChunkCacheLLM(chunk_cache=cache)
    as_list = {"context": retriever, "question": RunnablePassthrough()} | prompt | llm
    with pytest.warns(EscapedChunksWarning):
        as_list.invoke("what does it raise?")

    def join(docs: list[Document]) -> str:
        return "\n\n".join(doc.page_content for doc in docs)

    joined = {"context": retriever | join, "question": RunnablePassthrough()} | prompt | llm
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        answer = joined.invoke("what does it raise?")
    assert answer.response_metadata["chunkcache"]["chunk_misses"] == 1  # found, first seen

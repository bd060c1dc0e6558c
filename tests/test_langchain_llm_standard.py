"""langchain-tests' standard integration suite: ChunkCacheLLM on the local engine.

Runs the default model (SmolLM2-135M-Instruct) in process, so it is slow.  What
the model cannot do (tool calling, structured output, JSON mode, images, audio,
PDFs) is declared unsupported through the suite's properties; the unit suite (on
the fake backend) is in ``test_langchain_llm.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_tests.integration_tests import ChatModelIntegrationTests

from chunkcache.core import ChunkCache
from chunkcache.integrations.langchain import ChunkCacheLLM

local_backend = pytest.importorskip("chunkcache.core.local_backend")

CHUNK = (
    "The json module's dumps function serializes a Python object to a JSON formatted "
    "string; loads parses such a string back into Python objects."
)


@pytest.fixture(scope="module")
def backend() -> Any:
    return local_backend.LocalBackend.default()


@pytest.mark.slow
class TestChunkCacheLLMOnLocalEngine(ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _backend(self, backend: Any) -> None:
        self._local_backend = backend

    @property
    def chat_model_class(self) -> type[ChunkCacheLLM]:
        return ChunkCacheLLM

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"chunk_cache": ChunkCache(backend=self._local_backend), "max_tokens": 32}

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False  # the model is the backend's; use another ChunkCache(backend=...)

    @property
    def supported_usage_metadata_details(self) -> dict[Any, Any]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """Ask twice about the same chunk: the second prompt reads it from cache."""
        llm = ChunkCacheLLM(**self.chat_model_params)
        prompt = f"Context: {CHUNK}\n\nWhat does dumps return?"
        chunks = [("json-doc", CHUNK)]
        llm.invoke(prompt, chunks=chunks)
        if not stream:
            return llm.invoke(prompt, chunks=chunks)
        full: AIMessageChunk | None = None
        for piece in llm.stream(prompt, chunks=chunks):
            full = piece if full is None else full + piece
        assert full is not None
        return full

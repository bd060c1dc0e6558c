"""LlamaIndex ChunkCacheLLM: the other names LlamaIndex has for the text roles, tool roles,
and the prompt-caching marker block."""

from __future__ import annotations

import pytest
from fake_backend import FakeBackend
from llama_index.core.base.llms.types import (
    CacheControl,
    CachePoint,
    ChatMessage,
    MessageRole,
    TextBlock,
)
from test_llama_index_llm import backend_of, make_llm

from chunkcache.core.generation import GenerationRequest


def sent_text(request: GenerationRequest) -> str:
    return "".join(segment.text for segment in request.segments)


@pytest.mark.parametrize(
    ("role", "sent_as"),
    [
        (MessageRole.DEVELOPER, "system"),
        (MessageRole.CHATBOT, "assistant"),
        (MessageRole.MODEL, "assistant"),
    ],
)
def test_other_names_of_text_roles_are_sent_as_the_template_role(
    role: MessageRole, sent_as: str
) -> None:
    """``developer`` is OpenAI's name for system; ``chatbot`` (Cohere) and ``model``
    (Gemini) name the assistant's turn."""
    llm = make_llm()
    llm.chat([ChatMessage(role=role, content="said"), ChatMessage(content="hi")])
    expected = FakeBackend().render_chat(
        [{"role": sent_as, "content": "said"}, {"role": "user", "content": "hi"}]
    )
    assert sent_text(backend_of(llm).requests[-1]) == expected


@pytest.mark.parametrize("role", [MessageRole.TOOL, MessageRole.FUNCTION])
def test_tool_roles_are_still_refused(role: MessageRole) -> None:
    llm = make_llm()
    with pytest.raises(ValueError, match=f"'{role.value}' message.*no tool calling"):
        llm.chat([ChatMessage(content="hi"), ChatMessage(role=role, content="42")])
    assert backend_of(llm).requests == []


def test_a_cache_point_block_is_ignored() -> None:
    """A provider prompt-caching marker carries no text; the engine caches on its own."""
    cache_point = CachePoint(cache_control=CacheControl(type="ephemeral"))
    llm = make_llm()
    blocks = [TextBlock(text="a"), cache_point, TextBlock(text="b")]
    llm.chat([ChatMessage(role=MessageRole.SYSTEM, blocks=blocks), ChatMessage(content="hi")])
    expected = FakeBackend().render_chat(
        [{"role": "system", "content": "a\nb"}, {"role": "user", "content": "hi"}]
    )
    assert sent_text(backend_of(llm).requests[-1]) == expected

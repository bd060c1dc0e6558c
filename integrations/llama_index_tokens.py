"""Counting tokens for LlamaIndex as the model does.

LlamaIndex's response synthesizers pack retrieved text up to ``metadata.context_window``,
counting with ``Settings.tokenizer`` (tiktoken unless set). With another tokenizer a full
prompt can exceed the model's window: SmolLM2 splits numbers into single digits, tiktoken
does not, and the chat template's own tokens are not counted at all.
:func:`model_prompt_helper` counts with the model's tokenizer and renders chat prompts as
they are sent; :func:`refusal_explained` names that fix on a refused prompt.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, LLMMetadata
from llama_index.core.indices.prompt_helper import PromptHelper
from llama_index.core.utilities.token_counting import TokenCounter

from chunkcache.core.errors import PromptTooLongError

COUNTING_HINT = (
    "If LlamaIndex packed this prompt, it counted tokens with Settings.tokenizer (tiktoken "
    "unless set), not the model's tokenizer: build the query engine with "
    "response_synthesizer=get_response_synthesizer(llm=llm, prompt_helper=llm.prompt_helper()),"
    " or set Settings.tokenizer = llm.cache.backend.tokenizer for all of LlamaIndex"
)


def model_prompt_helper(
    metadata: LLMMetadata,
    tokenizer: Any,
    render_chat: Callable[[list[ChatMessage]], str],
    system_prompt: str,
    **kwargs: Any,
) -> PromptHelper:
    """A ``PromptHelper`` for ``metadata``'s window counting with ``tokenizer`` (a Hugging
    Face tokenizer); a chat prompt counts as ``render_chat`` renders it, the LLM's
    ``system_prompt`` included. ``kwargs`` go to ``PromptHelper.from_llm_metadata``."""
    counter = _ModelTokenCounter(tokenizer, render_chat, system_prompt)
    helper = PromptHelper.from_llm_metadata(metadata, tokenizer=counter.tokenizer, **kwargs)
    # PromptHelper counts a chat prompt's messages with its own estimate (the message
    # text by Settings.tokenizer, 3 tokens each); it has no public way to replace it.
    helper._token_counter = counter
    return helper


@contextmanager
def refusal_explained() -> Iterator[None]:
    """A PromptTooLongError, with how to make LlamaIndex pack prompts that fit."""
    try:
        yield
    except PromptTooLongError as error:
        raise PromptTooLongError(f"{error}. {COUNTING_HINT}") from error


class _ModelTokenCounter(TokenCounter):
    """LlamaIndex's token counter on the model's tokenizer; chat messages count as the
    prompt ``render_chat`` makes of them."""

    def __init__(
        self,
        tokenizer: Any,
        render_chat: Callable[[list[ChatMessage]], str],
        system_prompt: str,
    ) -> None:
        super().__init__(tokenizer=functools.partial(_token_ids, tokenizer))
        self._render_chat = render_chat
        self._system_prompt = system_prompt

    def estimate_tokens_in_messages(self, messages: list[ChatMessage]) -> int:
        # LlamaIndex's predict() puts the LLM's system_prompt first; PromptHelper counts
        # that text itself, so only what the template adds around it is counted here.
        sent = self._render_chat(list(messages))
        return self.get_string_tokens(sent) - self.get_string_tokens(self._system_prompt)


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids

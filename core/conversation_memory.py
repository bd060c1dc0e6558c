"""What the engine keeps of each conversation: its last sequences' tokens and KV, which the
next turn reuses as an exact prefix.

A conversation may send prompts of more than one shape each turn: LangChain's
``create_history_aware_retriever`` and LlamaIndex's ``condense_plus_context`` chat engine
have the model rephrase the question before it writes the answer.  Each shape keeps its
own last sequence, replaced by the next prompt that continues it (shares nearly all of its
prompt as a prefix), so the two calls do not evict each other's prefix turn after turn.  An
app whose every prompt starts anew (LlamaIndex's ``ContextChatEngine`` rewrites the system
message each turn) continues nothing: of sequences no prompt has continued yet, a
conversation keeps :data:`UNCONTINUED_PER_CONVERSATION`, and they go before the shapes an
app sends again.

Bounded three ways, the least recently used going first: ``max_conversations``
conversations, :data:`SEQUENCES_PER_CONVERSATION` sequences in each, and ``max_tokens`` KV
tokens in all.  Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from chunkcache.kernels.kv import SeqKV

# Prompt shapes a conversation keeps at once: an answer, a rephrasing, and room for an
# app's own step or an edited history, before the least recently used one goes.
SEQUENCES_PER_CONVERSATION = 4
# Of them, ones no later prompt continued yet: each shape's first turn (three shapes: a
# rephrasing, an answer, an app's own step), or a prompt that starts anew every turn.
UNCONTINUED_PER_CONVERSATION = 3
# A new sequence continues a kept one (and replaces it) when it shares this share of the
# kept one's prompt as a prefix: a next turn shares all of it (its answer's re-rendered
# tail may differ); another prompt shape shares the chat template and at most a system
# prompt, which may be most of a short first turn, never nearly all of it.
CONTINUES_SHARE = 0.9


@dataclass(frozen=True)
class Past:
    """A conversation's kept sequence: its tokens and their KV, with no spare capacity."""

    ids: tuple[int, ...]  # the tokens whose KV ``kv`` holds: the prompt, then its answer
    kv: SeqKV  # capacity == length
    exact_until: int  # slots before this hold exactly what a full prefill would compute
    prompt_length: int  # the prompt's tokens, before the answer


@dataclass(frozen=True)
class _Kept:
    past: Past
    continued: bool  # it replaced a sequence it continues: a shape the app sends again


class ConversationMemory:
    """Each conversation's kept sequences, bounded by conversations and tokens."""

    def __init__(self, max_conversations: int, max_tokens: int) -> None:
        self.max_conversations = max_conversations
        self.max_tokens = max_tokens
        # conversation id -> its sequences, least recently used first
        self._conversations: OrderedDict[str, list[_Kept]] = OrderedDict()
        self._lock = threading.Lock()

    def longest_match(self, conversation_id: str, ids: Sequence[int]) -> tuple[Past | None, int]:
        """The kept sequence of ``conversation_id`` sharing the longest prefix with ``ids``,
        and that prefix's length; (None, 0) for none.  A use: it and its conversation become
        the most recently used."""
        with self._lock:
            kept = self._conversations.get(conversation_id)
            if not kept:
                return None, 0
            self._conversations.move_to_end(conversation_id)
            shared, best = max((_common_prefix(ids, k.past.ids), i) for i, k in enumerate(kept))
            kept.append(kept.pop(best))
            return kept[-1].past, shared

    def keep(self, conversation_id: str, past: Past) -> None:
        """Keep ``past`` in place of the sequence it continues (or beside the others, older
        uncontinued ones going first over the per-conversation bounds), then forget the
        least recently used conversations over ``max_conversations``, and the least
        recently used conversation's oldest sequences over ``max_tokens``.  A sequence over
        ``max_tokens`` on its own is not kept; the one it continues is dropped."""
        with self._lock:
            kept = self._conversations.setdefault(conversation_id, [])
            self._conversations.move_to_end(conversation_id)
            others = [k for k in kept if not _continues(past.ids, k.past)]
            continued = len(others) < len(kept)
            kept[:] = others
            if past.kv.length <= self.max_tokens:
                kept.append(_Kept(past, continued))
                _trim(kept)
            if not kept:
                del self._conversations[conversation_id]
            while len(self._conversations) > self.max_conversations:
                self._conversations.popitem(last=False)
            while self._num_tokens() > self.max_tokens:  # the new one fits on its own
                oldest = next(iter(self._conversations.values()))
                del oldest[0]  # that conversation's least recently used sequence
                if not oldest:
                    self._conversations.popitem(last=False)

    def lengths(self) -> dict[str, int]:
        """The KV tokens kept for each conversation, least recently used first."""
        with self._lock:
            return {
                c: sum(k.past.kv.length for k in kept) for c, kept in self._conversations.items()
            }

    def pasts(self) -> Iterator[Past]:
        """Every kept sequence (a snapshot)."""
        with self._lock:
            pasts = [k.past for kept in self._conversations.values() for k in kept]
        return iter(pasts)

    def _num_tokens(self) -> int:
        return sum(k.past.kv.length for kept in self._conversations.values() for k in kept)


def _trim(kept: list[_Kept]) -> None:
    """Drop from one conversation's ``kept`` (least recently used first, the newest last)
    until its bounds hold: the oldest uncontinued sequence but the newest goes first, then
    the oldest."""
    while (
        len(kept) > SEQUENCES_PER_CONVERSATION
        or sum(not k.continued for k in kept) > UNCONTINUED_PER_CONVERSATION
    ):
        uncontinued = [i for i, k in enumerate(kept[:-1]) if not k.continued]
        del kept[uncontinued[0] if uncontinued else 0]


def _continues(new: Sequence[int], old: Past) -> bool:
    """Whether ``new`` continues ``old``: shares :data:`CONTINUES_SHARE` of its prompt."""
    return _common_prefix(new, old.ids) >= CONTINUES_SHARE * old.prompt_length


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n

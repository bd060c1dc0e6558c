"""Next-token choice and stop strings for decoding."""

from __future__ import annotations

import torch
from torch import Tensor

from chunkcache.core.generation import SamplingParams


def sample_token(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0, else nucleus (top-p) sampling at ``temperature``."""
    # logits: [V] float32
    if params.temperature == 0:
        return int(logits.argmax())
    # Shifted so the largest is 0: a tiny temperature scales to -inf, never to inf - inf.
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)  # probs: [V]
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)  # [V] each
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p  # [V] bool
        sorted_probs[outside] = 0
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


class StopChecker:
    """Finds the first stop string in streamed text and holds back what might start one."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = tuple(s for s in stop if s)
        self._holdback = max((len(s) - 1 for s in self.stop), default=0)

    def split(self, text: str) -> tuple[str, bool]:
        """``(text safe to emit, stopped)`` for the whole text generated so far."""
        cut = self._first_stop(text)
        if cut >= 0:
            return text[:cut], True
        return text[: len(text) - self._holdback] if self._holdback else text, False

    def final(self, text: str) -> str:
        """The whole answer once generation ended: cut at the first stop string, if any."""
        cut = self._first_stop(text)
        return text[:cut] if cut >= 0 else text

    def _first_stop(self, text: str) -> int:
        return min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)

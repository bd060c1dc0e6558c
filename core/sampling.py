"""Next-token choice and stop strings for decoding."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from chunkcache.core.generation import SamplingParams

PARTIAL_CHAR = "\ufffd"  # what a tokenizer decodes the bytes of an unfinished character to


def sample_token(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0, else nucleus (top-p) sampling at ``temperature``: from the
    fewest most likely tokens whose probabilities add up to ``top_p``.

    Samples in float64 on the generator's device (a seed gives the same tokens whatever
    device the model runs on).  Logits of +inf share all the probability; a NaN logit, or
    every logit -inf, is a RuntimeError (a broken model, not a token to emit).
    """
    # logits: [V]; float64 keeps a tiny temperature's 1/T finite (float32 rounds 1e-50 to 0)
    device = generator.device if generator is not None else logits.device
    logits = logits.to(device, torch.float64)
    if bool(logits.isnan().any()):
        raise RuntimeError("the model's next-token logits hold NaN")
    top = float(logits.max())
    if top == -math.inf:
        raise RuntimeError("every next-token logit is -inf: no token can be sampled")
    if top == math.inf:  # the limit of the softmax: the +inf logits share all the mass
        logits = torch.zeros_like(logits).masked_fill_(logits != math.inf, -math.inf)
        top = 0.0
    if params.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax((logits - top) / float(params.temperature), dim=-1)  # probs: [V]
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)  # [V] each
        # Drop a token once those before it already hold top_p: the smallest such set.
        sorted_probs[sorted_probs.cumsum(-1) - sorted_probs >= params.top_p] = 0
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


class StopChecker:
    """Finds the first stop string in streamed text and holds back what might start one."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = tuple(s for s in stop if s)
        self._holdback = max((len(s) - 1 for s in self.stop), default=0)

    def split(self, text: str) -> tuple[str, bool]:
        """``(text safe to emit, stopped)`` for the whole text generated so far: cut at the
        first stop string, else without its end that might start one, or that is an
        unfinished character (U+FFFD: a tokenizer may show one per byte still to be joined,
        more characters than the text will hold)."""
        cut = self._first_stop(text)
        if cut >= 0:
            return text[:cut], True
        settled = text.rstrip(PARTIAL_CHAR)
        return settled[: max(len(settled) - self._holdback, 0)], False

    def final(self, text: str) -> str:
        """The whole answer once generation ended: cut at the first stop string, if any."""
        cut = self._first_stop(text)
        return text[:cut] if cut >= 0 else text

    def _first_stop(self, text: str) -> int:
        return min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)

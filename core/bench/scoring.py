"""Distances between a policy's next-token distributions and a full prefill's.

Quality is measured along full's greedy answer (teacher forcing: the model reads
full's answer and we compare next-token distributions at every step) and on each
policy's own greedy answer (ROUGE-L F1 against full's).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import Tensor

from chunkcache.core.model_forward import embed, prefill, run_layers
from chunkcache.core.models import LoadedModel
from chunkcache.kernels.kv import SeqKV
from chunkcache.kernels.layer import Rows


@torch.no_grad()
def all_logits(lm: LoadedModel, ids: Tensor, kv: SeqKV) -> Tensor:
    """Float32 next-token logits after each of tokens ``ids``, appended to ``kv`` in place:
    :func:`~chunkcache.core.model_forward.prefill` keeping every row."""
    # ids: [N] long -> [N, V]
    start = kv.length
    kv.extend(ids.numel())
    rows = Rows.build(torch.arange(start, kv.length, device=lm.device), kv.length, lm.rope)
    x = run_layers(lm, embed(lm, ids.to(lm.device)), rows, kv)  # x: [N, E]
    return lm.lm_head(lm.decoder.norm(x)).float()


def greedy(
    lm: LoadedModel, logits: Tensor, kv: SeqKV, max_tokens: int, eos_ids: Collection[int]
) -> list[int]:
    """Greedy tokens from next-token ``logits`` [V] over ``kv`` (extended in place), one
    forward per token; an EOS token ends the answer and is kept."""
    tokens = [int(logits.argmax())]
    while tokens[-1] not in eos_ids and len(tokens) < max_tokens:
        logits, _ = prefill(lm, torch.tensor(tokens[-1:]), kv)
        tokens.append(int(logits.argmax()))
    return tokens


def forced_log_probs(lm: LoadedModel, logits: Tensor, kv: SeqKV, tokens: Sequence[int]) -> Tensor:
    """Log-probs of the next token before each of ``tokens`` given the ones before it:
    ``logits`` [V] follow the prompt in ``kv`` (extended in place by ``tokens[:-1]``)."""
    rows = [logits[None]]
    if len(tokens) > 1:
        rows.append(all_logits(lm, torch.tensor(tokens[:-1], dtype=torch.long), kv))  # [T-1, V]
    return torch.log_softmax(torch.cat(rows), dim=-1)  # [T, V]


def teacher_forced(
    lm: LoadedModel,
    logits: Tensor,
    kv: SeqKV,
    tokens: Sequence[int],
    max_tokens: int,
    eos_ids: Collection[int],
) -> tuple[Tensor, list[int]]:
    """Log-probs of the next token before each of ``tokens`` (a greedy answer of at most
    ``max_tokens``) given the ones before it, and the model's own greedy answer.

    ``logits`` [V] follow the prompt in ``kv``; the tokens run in one causal forward,
    which equals feeding them one by one.  The own answer follows ``tokens`` up to its
    first different choice and only then runs on by itself (``kv`` cut back there).
    """
    start = kv.length
    log = forced_log_probs(lm, logits, kv, tokens)  # log: [T, V]
    differ = (log.argmax(dim=-1).cpu() != torch.tensor(tokens)).nonzero()
    if differ.numel() == 0:
        return log, list(tokens)
    step = int(differ[0, 0])
    kv.length = start + step  # the KV of tokens[:step] only
    return log, [*tokens[:step], *greedy(lm, log[step], kv, max_tokens - step, eos_ids)]


def kl_divergence(p_log: Tensor, q_log: Tensor) -> Tensor:
    """KL(p || q) per row, from log-probabilities."""
    # p_log, q_log: [T, V] -> [T]
    return (p_log.exp() * (p_log - q_log)).sum(dim=-1).clamp_min(0.0)


def rouge_l_f1(candidate: Sequence[object], reference: Sequence[object]) -> float:
    """ROUGE-L F1: the longest common subsequence over precision and recall."""
    if not candidate or not reference:
        return float(candidate == reference)
    previous = [0] * (len(reference) + 1)
    for item in candidate:
        current = [0]
        for j, other in enumerate(reference):
            current.append(previous[j] + 1 if item == other else max(previous[j + 1], current[j]))
        previous = current
    lcs = previous[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(candidate), lcs / len(reference)
    return 2 * precision * recall / (precision + recall)

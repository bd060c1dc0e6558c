"""Decoding settings: every bad value is refused up front; sampling is stable at the edges."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from chunkcache.core.generation import SamplingParams
from chunkcache.core.sampling import sample_token


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"max_tokens": 1.5},
        {"max_tokens": True},
        {"max_tokens": "8"},
        {"max_tokens": None},
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"temperature": 10**400},  # an int no float can hold
        {"temperature": "0.5"},
        {"top_p": 0.0},
        {"top_p": math.nan},
        {"top_p": 1.5},
        {"seed": 2**70},
        {"seed": -1},
        {"seed": "x"},
        {"seed": 1.0},
        {"stop": ("ok", 3)},
        {"stop": "END"},  # a string is a sequence of one-letter stop strings: refused
    ],
)
def test_bad_settings_are_refused_with_a_clear_error(bad: dict[str, Any]) -> None:
    (name,) = bad
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)


def test_edge_settings_that_make_sense_are_kept() -> None:
    SamplingParams(max_tokens=1, temperature=0, top_p=1e-9, seed=2**64 - 1, stop=("",))
    SamplingParams(temperature=10**300)


def test_a_huge_temperature_samples_near_uniformly() -> None:
    params = SamplingParams(temperature=10**300, seed=0)
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([50.0, 0.0, 0.0, 0.0])  # [V]
    picks = {sample_token(logits, params, generator) for _ in range(64)}
    assert picks == {0, 1, 2, 3}


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-20])
def test_a_tiny_temperature_samples_the_argmax(temperature: float) -> None:
    logits = torch.tensor([1.0, 30.0, -5.0, 29.5])  # [V]
    params = SamplingParams(temperature=temperature, seed=0)
    generator = torch.Generator().manual_seed(0)
    assert {sample_token(logits, params, generator) for _ in range(20)} == {1}

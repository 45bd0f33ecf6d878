"""Sampling: greedy, seeds, top-k / top-p truncation, parameter validation."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import SamplingParams, make_generator, sample

CPU = torch.device("cpu")


def _logits() -> torch.Tensor:
    return torch.log_softmax(torch.tensor([[0.1, 2.0, 0.5, 1.9, -1.0]]), dim=-1)


def test_greedy_picks_argmax() -> None:
    p = SamplingParams(max_tokens=1)
    assert sample(_logits(), [p], [make_generator(p, CPU)]) == [1]


def test_same_seed_same_tokens_different_seed_differs() -> None:
    logits = torch.zeros(1, 1000)

    def draw(seed: int) -> list[int]:
        p = SamplingParams(max_tokens=1, temperature=1.0, seed=seed)
        gen = make_generator(p, CPU)
        return [sample(logits, [p], [gen])[0] for _ in range(8)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    for p in (
        SamplingParams(max_tokens=1, temperature=1.0, top_k=1, seed=3),
        SamplingParams(max_tokens=1, temperature=1.0, top_p=0.01, seed=3),
    ):
        assert all(sample(_logits(), [p], [make_generator(p, CPU)]) == [1] for _ in range(20))


def test_top_k_two_only_draws_top_two() -> None:
    p = SamplingParams(max_tokens=1, temperature=5.0, top_k=2, seed=0)
    gen = make_generator(p, CPU)
    assert {sample(_logits(), [p], [gen])[0] for _ in range(200)} == {1, 3}


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(max_tokens=1, temperature=-1), "temperature"),
        (SamplingParams(max_tokens=1, top_p=0.0), "top_p"),
        (SamplingParams(max_tokens=1, top_k=-2), "top_k"),
        (SamplingParams(max_tokens=1, stop=("",)), "stop"),
    ],
)
def test_invalid_params_name_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        params.validate()

"""Sampling: greedy, seeds, min-p / top-k / top-p truncation, parameter validation."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import SamplingParams, _truncated_probs, make_generator, reference_probs, sample

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
        (SamplingParams(max_tokens=1, logprobs=-1), "logprobs"),
        (SamplingParams(max_tokens=1, logprobs=21), "logprobs"),
    ],
)
def test_invalid_params_name_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        params.validate()


CUTS = [
    SamplingParams(max_tokens=1, temperature=1.0),
    SamplingParams(max_tokens=1, temperature=0.7, top_k=5),
    SamplingParams(max_tokens=1, temperature=1.3, top_p=0.9),
    SamplingParams(max_tokens=1, temperature=0.9, top_k=50, top_p=0.8),
    SamplingParams(max_tokens=1, temperature=2.0, top_k=3000),  # top-k of the whole vocabulary: no cut
    SamplingParams(max_tokens=1, temperature=0.8, min_p=0.1),
    SamplingParams(max_tokens=1, temperature=1.5, min_p=0.02, top_k=40, top_p=0.9),
    SamplingParams(max_tokens=1, temperature=1.0, min_p=1.0),  # the top token alone
]


def test_cuts_of_many_rows_at_once_match_the_reference() -> None:
    torch.manual_seed(0)
    logits = torch.randn(len(CUTS) + 1, 3000) * 3
    # A nearly flat row of distinct scores: its nucleus is 2694 tokens, past the 1024 candidates sorted first.
    logits[-1] = torch.linspace(0.0, 0.05, 3000)
    params = [*CUTS, SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9)]
    together = _truncated_probs(logits, params)
    for row, p in enumerate(params):
        torch.testing.assert_close(together[row], reference_probs(logits[row], p), rtol=1e-6, atol=1e-7)
    assert int((together[-1] > 0).sum()) == 2694
    kept = [int((together[row] > 0).sum()) for row in (5, 6, 7)]
    assert 1 < kept[0] < 3000 and 1 < kept[1] <= 40 and kept[2] == 1  # each min-p row cut, not emptied


def test_min_p_is_relative_to_the_top_token_after_temperature() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for temperature, min_p, kept in (
        (1.0, 0.25, [0, 1, 2]),
        (1.0, 0.5, [0, 1]),
        (0.5, 0.25, [0, 1]),
        (2.0, 0.25, [0, 1, 2, 3]),
    ):
        p = SamplingParams(max_tokens=1, temperature=temperature, min_p=min_p)
        assert _truncated_probs(logits, [p])[0].nonzero().flatten().tolist() == kept, (temperature, min_p)


@pytest.mark.parametrize("params", [*CUTS[:4], CUTS[5]])
def test_draws_follow_the_reference_distribution(params: SamplingParams) -> None:
    torch.manual_seed(1)
    row = torch.randn(8) * 2
    want = reference_probs(row, params)
    want = want / want.sum()  # a cut leaves its kept mass unnormalised: drawing normalises
    draws = sample(row.repeat(4000, 1), [params] * 4000, [None] * 4000)
    seen = torch.bincount(torch.tensor(draws), minlength=8).float() / 4000
    assert torch.all(seen[want == 0] == 0)  # never a token the cuts removed
    torch.testing.assert_close(seen, want, rtol=0, atol=0.035)


def test_seeded_rows_do_not_depend_on_their_neighbours() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 500) * 2  # row 0 is the seeded request's, in every batch
    mine = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.95, seed=7)
    others = [SamplingParams(max_tokens=1, temperature=1.0), SamplingParams(max_tokens=1, temperature=0.5, seed=3)]

    def draws(before: list[SamplingParams]) -> list[int]:
        batch = [*before, mine]
        rows = torch.cat([logits[1 : 1 + len(before)], logits[:1]])
        generators = [make_generator(p, CPU) for p in batch]
        return [sample(rows, batch, generators)[-1] for _ in range(12)]

    alone = draws([])
    assert len(set(alone)) > 1
    assert draws([others[0]]) == alone
    assert draws(others) == alone


def test_unseeded_rows_respect_their_cuts_when_drawn_together() -> None:
    logits = _logits().repeat(3, 1)
    params = [
        SamplingParams(max_tokens=1, temperature=5.0, top_k=2),
        SamplingParams(max_tokens=1, temperature=1.0, top_p=0.01),
        SamplingParams(max_tokens=1, temperature=5.0),
    ]
    assert [make_generator(p, CPU) for p in params] == [None, None, None]
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(300):
        for row, token in enumerate(sample(logits, params, [None, None, None])):
            seen[row].add(token)
    assert seen[0] == {1, 3} and seen[1] == {1} and seen[2] == {0, 1, 2, 3, 4}


def test_a_step_reads_its_tokens_back_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU step waits for every device-to-host read: sampled rows were once read back one by one."""
    reads: list[str] = []
    tolist, item = torch.Tensor.tolist, torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append("tolist") or tolist(t))
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append("item") or item(t))
    params = [SamplingParams(max_tokens=1, temperature=1.0, seed=s) for s in range(6)]
    params += [SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9)]
    tokens = sample(torch.randn(8, 100), params, [make_generator(p, CPU) for p in params])
    assert len(tokens) == 8 and reads == ["tolist"]


def test_a_tiny_temperature_draws_the_top_token() -> None:
    """Logits over a temperature near float32's smallest value overflowed to inf, softmax turned them into
    NaN, and every draw fell past the end: the vocabulary's last token, whatever the logits."""
    logits = _logits().repeat(2, 1) * 10
    for temperature in (1e-3, 1e-40):
        p = SamplingParams(max_tokens=1, temperature=temperature, seed=0)
        p.validate()
        assert sample(logits, [p, p], [make_generator(p, CPU), None]) == [1, 1]


def test_a_seeded_row_with_tied_scores_does_not_depend_on_its_neighbours() -> None:
    """Which tokens tied at the nucleus' edge were kept followed the order a sort gave them, and a row was
    sorted whole or through its top 1024 depending on its neighbours: a seeded request's tokens changed with
    the batch around it (ties are common in bfloat16 logits)."""
    tied = torch.full((3000,), -5.0)
    tied[:1500] = 5.0  # 1500 equally likely tokens; top_p 0.3 cuts through them
    mine = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.3, seed=7)
    wide = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9)  # a flat row: sorted whole

    def draws(rows: torch.Tensor, batch: list[SamplingParams]) -> tuple[set[int], list[int]]:
        kept = set(_truncated_probs(rows, batch)[0].nonzero().flatten().tolist())
        generators = [make_generator(p, CPU) for p in batch]
        return kept, [sample(rows, batch, generators)[0] for _ in range(20)]

    alone = draws(tied[None], [mine])
    assert alone == draws(torch.stack([tied, torch.zeros(3000)]), [mine, wide])
    assert alone[0] == set(range(1500))  # every token tied at the edge is kept, as top-k keeps its ties

"""Log-probabilities of a step's rows (`engine.logprobs`): the raw distribution's values for the rows that asked,
in one batched computation and one read per step."""

from __future__ import annotations

import pytest
import torch

from engine.logprobs import MAX_LOGPROBS, StepLogprobs, read_logprobs
from engine.sampling import SamplingParams, make_generator, sample_tokens

CPU = torch.device("cpu")
VOCAB = 64


def _step(wanted: list[int | None], params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(len(wanted), VOCAB, generator=torch.Generator().manual_seed(len(wanted))) * 3
    return logits, sample_tokens(logits, params, [make_generator(p, CPU) for p in params])


def test_rows_that_asked_get_their_raw_log_softmax_and_the_others_nothing() -> None:
    params = [
        SamplingParams(max_tokens=1, temperature=0.7, top_k=5, seed=1, logprobs=3),
        SamplingParams(max_tokens=1),
        SamplingParams(max_tokens=1, temperature=1.5, top_p=0.8, seed=2, logprobs=0),
        SamplingParams(max_tokens=1, logprobs=MAX_LOGPROBS),
        SamplingParams(max_tokens=1, temperature=1.0, seed=3),
    ]
    logits, tokens = _step([p.logprobs for p in params], params)
    step = StepLogprobs.compute(logits, tokens, [p.logprobs for p in params])
    assert step is not None
    out = step.read(len(params))
    assert out[1] is None and out[4] is None
    reference = torch.log_softmax(logits, dim=-1)  # before temperature and cuts: the raw distribution
    for row, p in enumerate(params):
        entry = out[row]
        if p.logprobs is None:
            continue
        assert entry is not None
        token = int(tokens[row])
        assert entry.logprob == pytest.approx(float(reference[row, token]), abs=1e-6)
        best = reference[row].topk(p.logprobs)
        assert [i for i, _ in entry.top] == best.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(best.values.tolist(), abs=1e-6)
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
    assert out[3] is not None and out[3].top[0][0] == int(tokens[3])  # greedy: the sampled token is the best


def test_a_sampled_token_outside_the_top_keeps_its_own_logprob() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, -2.0]])
    step = StepLogprobs.compute(logits, torch.tensor([3]), [2])
    assert step is not None
    (entry,) = step.read(1)
    reference = torch.log_softmax(logits[0], dim=-1).tolist()
    assert entry is not None and entry.logprob == pytest.approx(reference[3], abs=1e-6)
    assert [i for i, _ in entry.top] == [0, 1]
    assert [v for _, v in entry.top] == pytest.approx(reference[:2], abs=1e-6)


def test_a_step_without_asking_rows_computes_nothing() -> None:
    logits = torch.randn(3, VOCAB)
    assert StepLogprobs.compute(logits, logits.argmax(-1), [None, None, None]) is None
    assert read_logprobs(None, 3) == [None, None, None]


def test_one_batched_computation_and_one_read_whatever_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per asking row, no kernel and no read of its own: a GPU step would wait for each read."""
    computed: list[tuple[int, ...]] = []
    reads: list[str] = []
    log_softmax, tolist, item = torch.log_softmax, torch.Tensor.tolist, torch.Tensor.item
    monkeypatch.setattr(torch, "log_softmax", lambda t, dim: computed.append(tuple(t.shape)) or log_softmax(t, dim))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append("tolist") or tolist(t))
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append("item") or item(t))
    wanted: list[int | None] = [2, None, 5, 0, None, 1, 20, 3]
    logits = torch.randn(len(wanted), VOCAB)
    step = StepLogprobs.compute(logits, logits.argmax(-1), wanted)
    assert step is not None
    out = step.read(len(wanted))
    assert computed == [(6, VOCAB)]  # the six asking rows, together
    assert reads == ["tolist", "tolist"]  # values and ids, once each for the step
    assert [None if e is None else len(e.top) for e in out] == wanted

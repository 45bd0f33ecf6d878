"""Logit processing (penalties, logit_bias, min_tokens) of many rows at once against the per-row reference, and
what it does to sampling: greedy rows too, the step's raw logits untouched, tokens still in flight counted."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import cast

import pytest
import torch

from engine import logits_processing
from engine.logits_processing import process_logits, reference_process
from engine.sampling import SamplingParams, make_generator, sample
from engine.sequence import Sequence
from engine.tokenizer import IncrementalDecoder

VOCAB = 64
EOS = frozenset({2, 5})
CPU = torch.device("cpu")


def make_seq(params: SamplingParams, output: list[int], prompt: list[int] | None = None) -> Sequence:
    return Sequence(
        request_id=str(id(params)),
        prompt_ids=prompt if prompt is not None else [3, 9, 9, 40],
        params=params,
        adapter=None,
        sink=lambda _: None,
        decoder=cast(IncrementalDecoder, None),  # processing never decodes
        generator=None,
        output_ids=list(output),
    )


def _p(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=32, **kw)  # type: ignore[arg-type]


# One row of each kind, and rows that use none (left alone); outputs repeat tokens, and some are prompt tokens.
ROWS = [
    (_p(), [1, 1, 7]),
    (_p(frequency_penalty=0.7), [1, 1, 7, 1, 12]),
    (_p(presence_penalty=-1.3), [1, 1, 7]),
    (_p(frequency_penalty=2.0, presence_penalty=2.0, temperature=0.8), [9, 9, 9, 30]),
    (_p(repetition_penalty=1.8), [7, 8, 7]),
    (_p(repetition_penalty=0.6, frequency_penalty=-0.4, top_k=5, temperature=1.0), [40, 41, 41]),
    (_p(logit_bias=((3, 100.0), (63, -100.0), (0, 0.5))), [4]),
    (_p(min_tokens=3), [6, 6]),  # two tokens of three: the end tokens are blocked
    (_p(min_tokens=2), [6, 6]),  # reached: left alone
    (_p(min_tokens=4, ignore_eos=True), []),  # the end tokens are ordinary tokens: nothing to block
    (_p(min_tokens=5, logit_bias=((2, 50.0),), repetition_penalty=1.2, presence_penalty=0.5), [2, 3]),
    (_p(temperature=0.9), []),
    (_p(min_tokens=3, stop_token_ids=(7, 40, 2)), [6]),  # stop tokens are blocked with the end tokens
    (_p(min_tokens=4, ignore_eos=True, stop_token_ids=(5, 9)), []),  # stop tokens only, an end token among them
    (_p(min_tokens=1, stop_token_ids=(7,)), [6]),  # reached: left alone
]


def make_logits(rows: int) -> torch.Tensor:
    torch.manual_seed(0)
    logits = torch.randn(rows, VOCAB) * 4
    logits[:, 9] = torch.linspace(-3.0, 3.0, rows)  # a prompt token, positive in some rows, negative in others
    return logits


def test_many_rows_at_once_match_the_per_row_reference() -> None:
    seqs = [make_seq(p, out) for p, out in ROWS]
    logits = make_logits(len(ROWS))
    raw = logits.clone()
    processed = process_logits(logits, seqs, EOS)
    assert processed is not None
    assert processed.rows == [1, 2, 3, 4, 5, 6, 7, 10, 12, 13]  # exactly the rows that use something
    assert processed.index.tolist() == processed.rows
    assert torch.equal(logits, raw)  # the step's logits stay the model's: log-probabilities read them
    for j, row in enumerate(processed.rows):
        p, out = ROWS[row]
        want = reference_process(raw[row], p, seqs[row].prompt_ids, out, EOS)
        torch.testing.assert_close(processed.logits[j], want, rtol=1e-6, atol=1e-5)
        assert not torch.equal(processed.logits[j], raw[row])  # each one really changed
    assert process_logits(logits, [seqs[0], seqs[8], seqs[9], seqs[11], seqs[14]], EOS) is None
    blocked = {12: {2, 5, 7, 40}, 13: {5, 9}}  # the end tokens (2, 5) unless ignore_eos, and the stop tokens
    for j, row in enumerate(processed.rows):
        if row in blocked:
            assert set(torch.nonzero(processed.logits[j].isinf()).flatten().tolist()) == blocked[row]


def test_the_reference_says_what_the_interface_promises() -> None:
    """The reference against hand-computed values, so that the two cannot agree on a wrong formula."""
    row = torch.tensor([2.0, -2.0, 1.0, 0.5, 3.0, -1.0])
    p = _p(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0, logit_bias=((5, 4.0),), min_tokens=4)
    got = reference_process(row, p, prompt=[0, 1], output=[2, 2, 5], eos_ids={4})
    # 0, 1: prompt only (repetition); 2: generated twice; 5: biased to 3.0, then generated once; 4: end, blocked.
    want = [1.0, -4.0, 0.5 - 2 * 0.5 - 0.25, 0.5, float("-inf"), 3.0 / 2 - 0.5 - 0.25]
    assert got.tolist() == pytest.approx(want)


@dataclass
class InFlightTokens:
    tokens: torch.Tensor
    rows: dict[Sequence, int] = field(default_factory=dict)


@pytest.mark.parametrize("params", [_p(frequency_penalty=1.5), _p(repetition_penalty=1.7)])
def test_a_token_in_flight_counts_as_generated(params: SamplingParams) -> None:
    """With async steps a sequence's newest token is still on the device when its next logits are processed."""
    logits = make_logits(1)
    output = [11, 6]  # the newest token, 6 (seen nowhere else), is the one in flight
    known = process_logits(logits, [make_seq(params, output)], EOS)
    waiting = make_seq(params, output[:-1])
    in_flight = InFlightTokens(torch.tensor([30, 6, 17]), {waiting: 1})  # its row in the step in flight: 1
    pending = process_logits(logits, [waiting], EOS, in_flight)
    assert known is not None and pending is not None
    assert torch.equal(pending.logits, known.logits)
    assert not torch.equal(process_logits(logits, [waiting], EOS).logits, known.logits)  # type: ignore[union-attr]


def test_min_tokens_ends_its_block_when_the_token_in_flight_reaches_it() -> None:
    waiting = make_seq(_p(min_tokens=3), [8, 8])
    assert process_logits(make_logits(1), [waiting], EOS) is not None
    assert process_logits(make_logits(1), [waiting], EOS, InFlightTokens(torch.tensor([8]), {waiting: 0})) is None


def test_greedy_rows_take_the_processed_argmax() -> None:
    logits = make_logits(4)
    top = logits.argmax(-1).tolist()
    params = [
        _p(logit_bias=((top[0], -100.0),)),  # the greedy token ruled out
        _p(logit_bias=((33, 100.0),)),  # a token forced
        _p(frequency_penalty=2.0),  # the greedy token already generated, many times
        _p(min_tokens=1),
    ]
    logits[3, 5] = 50.0  # an end token is the greedy choice, but min_tokens holds it off
    seqs = [
        make_seq(params[0], []),
        make_seq(params[1], []),
        make_seq(params[2], [top[2]] * 20),
        make_seq(params[3], []),
    ]
    processed = process_logits(logits, seqs, EOS)
    tokens = sample(logits, params, [None] * 4, processed)
    assert tokens[0] != top[0] and tokens[1] == 33 and tokens[2] != top[2] and tokens[3] not in EOS
    assert sample(logits, params, [None] * 4) == [top[0], top[1], top[2], 5]  # unprocessed: the raw argmax


def test_sampled_rows_draw_from_the_processed_logits() -> None:
    logits = make_logits(3)
    logits[1, 2] = 40.0  # an end token nearly certain
    params = [
        _p(temperature=1.0, seed=1, logit_bias=((17, 100.0),)),
        _p(temperature=1.0, min_tokens=8),
        _p(temperature=1.0, seed=3),  # beside them, unprocessed
    ]
    seqs = [make_seq(p, []) for p in params]
    processed = process_logits(logits, seqs, EOS)
    assert processed is not None and processed.rows == [0, 1]
    generators = [make_generator(p, CPU) for p in params]
    draws = [sample(logits, params, generators, processed) for _ in range(200)]
    assert {d[0] for d in draws} == {17}
    assert not {d[1] for d in draws} & EOS
    assert len({d[2] for d in draws}) > 5


def test_a_step_uploads_once_for_its_indices_and_once_for_its_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-row uploads (or reads) would make a GPU step wait once per processed row."""
    uploads: list[int] = []
    upload = logits_processing.upload

    def counted(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        uploads.append(len(values))
        return upload(values, dtype, device)

    monkeypatch.setattr(logits_processing, "upload", counted)
    reads: list[str] = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append("tolist"))
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append("item"))
    seqs = [make_seq(p, out) for p, out in ROWS]
    assert process_logits(make_logits(len(ROWS)), seqs, EOS) is not None
    assert len(uploads) == 2 and reads == []


def test_extreme_repetition_penalties_stay_finite() -> None:
    """Any positive repetition penalty is valid (vLLM's range); near 0 it overflowed positive logits to inf."""
    logits = make_logits(2)
    logits[:, 40] = 1.0  # a prompt token, divided by 1e-45: past float32's largest value
    seqs = [make_seq(_p(repetition_penalty=1e-45, temperature=1.0), [1]), make_seq(_p(repetition_penalty=3e38), [1])]
    processed = process_logits(logits, seqs, EOS)
    assert processed is not None
    assert not processed.logits.isnan().any() and not processed.logits.isposinf().any()
    assert sample(logits, [s.params for s in seqs], [None, None], processed)[0] == 40


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"min_p": 1.01}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 33}, "min_tokens"),  # past max_tokens
        ({"logit_bias": ((1, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((1, 1.0), (1, 2.0))}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "logit_bias"),
        ({"stop_token_ids": (3, -1)}, "stop_token_ids"),
        ({"stop_token_ids": tuple(range(65))}, "stop_token_ids"),
    ],
)
def test_invalid_settings_name_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        replace(_p(), **changes).validate()  # type: ignore[arg-type]


def test_logit_bias_ids_past_the_vocabulary_are_named() -> None:
    params = _p(logit_bias=((VOCAB, 1.0), (3, 1.0), (VOCAB + 7, -1.0)))
    params.validate()  # without a vocabulary, only negative ids are out
    with pytest.raises(ValueError, match=rf"token_id\(s\) \[{VOCAB}, {VOCAB + 7}\] in logit_bias .* size: {VOCAB}"):
        params.validate(VOCAB)
    _p(logit_bias=((VOCAB - 1, 1.0),), min_tokens=32, min_p=1.0, repetition_penalty=1e-3).validate(VOCAB)


def test_stop_token_ids_past_the_vocabulary_are_named() -> None:
    params = _p(stop_token_ids=(VOCAB + 1, 3, VOCAB, VOCAB))
    params.validate()  # without a vocabulary, only negative ids are out
    with pytest.raises(ValueError, match=rf"token_id\(s\) \[{VOCAB}, {VOCAB + 1}\] in stop_token_ids .* size: {VOCAB}"):
        params.validate(VOCAB)
    _p(stop_token_ids=tuple(range(VOCAB - 64, VOCAB)), min_tokens=32).validate(VOCAB)  # 64 ids, the last one

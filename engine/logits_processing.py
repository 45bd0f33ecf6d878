"""Logit processing before sampling: logit_bias, vLLM's repetition penalty, OpenAI's presence and frequency
penalties, and vLLM's min_tokens, for the rows of a step whose requests use them.

For one row, with `output` the tokens its request generated so far and `prompt` its prompt (vLLM's semantics;
`reference_process` is exactly this, one row at a time):

    logits[t] += logit_bias[t]
    for t in set(prompt + output):   logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
    for t in output:                 logits[t] -= frequency * count(t in output) + presence   (once per token)
    if len(output) < min_tokens:     logits[end] = -inf   (each stop_token_ids id, and each end-of-sequence id
                                                           unless ignore_eos or the request has a structured
                                                           output, whose grammar decides where it ends)

This comes before everything else the sampler does, so it changes greedy rows too (min-p is a cut of the
sampler's, after temperature: engine/sampling.py). The rows are processed on the device, together, on a
copy: the step's logits stay the model's raw distribution, which log-probabilities read (vLLM's
`raw_logprobs`). Each step uploads the tokens to count in one integer tensor and the values in one float
tensor, neither waiting for the device, and reads nothing back: an asynchronous step stays asynchronous.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from collections.abc import Sequence as Rows
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.sampling import ProcessedRows, SamplingParams
from engine.sequence import Sequence
from engine.uploads import upload


class TokensInFlight(Protocol):
    """The step before this one, whose tokens are still on the device (`engine.step_forward.InFlight`)."""

    @property
    def tokens(self) -> torch.Tensor:
        """The tokens it sampled, int64 [its rows] on the engine's device."""
        ...

    @property
    def rows(self) -> Mapping[Sequence, int]:
        """Each of its sequences' row in `tokens`."""
        ...


def _needs_processing(seq: Sequence, eos_ids: Collection[int], in_flight: bool = False) -> bool:
    """Whether `seq`'s next logits are processed: it asks for penalties or logit_bias, or is short of its
    min_tokens (`in_flight`: one more token was generated than its output holds)."""
    p = seq.params
    return p.penalized or bool(p.logit_bias) or bool(_blocked_ends(p, len(seq.output_ids) + in_flight, eos_ids))


def process_logits(
    logits: torch.Tensor, seqs: Rows[Sequence], eos_ids: Collection[int], previous: TokensInFlight | None = None
) -> ProcessedRows | None:
    """The processed logits of the rows of `logits` [B, vocab] (row i: `seqs[i]`'s next token) that need it
    (`_needs_processing`), or None when none does; `logits` itself is left as it is.

    `previous` is the step in flight, if any: each sequence it holds has generated its token there, not yet
    in `output_ids`, and that token counts as generated (read from the device, so steps stay asynchronous).
    """
    plan = _Plan()
    for i, seq in enumerate(seqs):
        pending = previous.rows.get(seq) if previous is not None else None
        # A complete grammar allows only the end-of-sequence token: min_tokens must not take that one away too.
        ends = () if seq.grammar is not None else eos_ids
        if _needs_processing(seq, ends, pending is not None):
            plan.add(i, seq, ends, pending)
    if not plan.rows:
        return None
    return plan.run(logits, previous.tokens if previous is not None else None)


def _blocked_ends(params: SamplingParams, generated: int, eos_ids: Collection[int]) -> list[int]:
    """The tokens that would end a request that has generated `generated` tokens and that min_tokens holds off
    (vLLM's `all_stop_token_ids`, less the end-of-sequence ids where ignore_eos makes them no end)."""
    if generated >= params.min_tokens:
        return []
    return sorted(set(params.stop_token_ids).union(() if params.ignore_eos else eos_ids))


@dataclass
class _Pairs:
    """(row, token) pairs as two flat lists: rows are positions among the processed rows."""

    rows: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def add(self, row: int, tokens: Rows[int]) -> None:
        self.rows.extend([row] * len(tokens))
        self.tokens.extend(tokens)


@dataclass
class _Plan:
    """What one step's processing does, gathered on the host and sent to the device at once."""

    rows: list[int] = field(default_factory=list)  # indices in the step
    bias: _Pairs = field(default_factory=_Pairs)
    biases: list[float] = field(default_factory=list)  # one per pair of `bias`
    ends: _Pairs = field(default_factory=_Pairs)  # end tokens that min_tokens blocks
    output: _Pairs = field(default_factory=_Pairs)  # generated tokens of penalized rows, one pair per occurrence
    prompt: _Pairs = field(default_factory=_Pairs)  # prompt tokens of repetition-penalized rows
    pending: _Pairs = field(default_factory=_Pairs)  # (row, its row in the step in flight) of penalized rows
    penalties: list[float] = field(default_factory=list)  # (frequency, presence, repetition) of each row

    def add(self, step_row: int, seq: Sequence, eos_ids: Collection[int], pending: int | None) -> None:
        row, p = len(self.rows), seq.params
        self.rows.append(step_row)
        self.penalties += [p.frequency_penalty, p.presence_penalty, p.repetition_penalty]
        self.bias.add(row, [t for t, _ in p.logit_bias])
        self.biases += [b for _, b in p.logit_bias]
        self.ends.add(row, _blocked_ends(p, len(seq.output_ids) + (pending is not None), eos_ids))
        if p.penalized:
            self.output.add(row, seq.output_ids)
            if pending is not None:
                self.pending.add(row, [pending])
        if p.repetition_penalty != 1.0:
            self.prompt.add(row, seq.prompt_ids)

    def run(self, logits: torch.Tensor, in_flight: torch.Tensor | None) -> ProcessedRows:
        pairs = (self.bias, self.ends, self.output, self.prompt, self.pending)
        lists = [self.rows, *(values for p in pairs for values in (p.rows, p.tokens))]
        ints = upload([v for values in lists for v in values], torch.long, logits.device)
        index, bias_rows, bias_tokens, end_rows, end_tokens, *counted = ints.split([len(v) for v in lists])
        floats = upload(self.biases + self.penalties, torch.float32, logits.device)
        biases, penalties = floats.split([len(self.biases), len(self.penalties)])
        vocab = logits.shape[-1]
        out = logits.index_select(0, index).float()  # a copy: the step's own logits stay raw
        # Flat positions (row * vocab + token) and scatter_add / index_fill: unlike indexing with a pair of
        # index tensors, they never wait for the device.
        out.view(-1).scatter_add_(0, bias_rows * vocab + bias_tokens, biases)
        if self.output.rows or self.prompt.rows or self.pending.rows:  # some row is penalized
            frequency, presence, repetition = penalties.view(-1, 3).unbind(1)
            out = _penalize(out, frequency, presence, repetition, counted, in_flight)
        # Last, and absolute: after a penalty's arithmetic, -inf must stay -inf and nothing else may become it.
        out.view(-1).index_fill_(0, end_rows * vocab + end_tokens, float("-inf"))
        return ProcessedRows(self.rows, index, out)


def _penalize(
    logits: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    repetition: torch.Tensor,
    counted: list[torch.Tensor],
    in_flight: torch.Tensor | None,
) -> torch.Tensor:
    """Repetition, frequency and presence penalties on `logits` [R, vocab]; `counted` holds the (row, token)
    pairs of the outputs, of the repetition-penalized prompts, and (row, row in flight) of tokens in flight."""
    output_rows, output_tokens, prompt_rows, prompt_tokens, pending_rows, pending_at = counted
    vocab = logits.shape[-1]
    tokens = output_rows * vocab + output_tokens
    if in_flight is not None:
        tokens = torch.cat([tokens, pending_rows * vocab + in_flight.index_select(0, pending_at)])
    counts = torch.zeros_like(logits)
    counts.view(-1).scatter_add_(0, tokens, torch.ones_like(tokens, dtype=counts.dtype))
    generated = counts > 0
    seen = generated.clone()
    seen.view(-1).index_fill_(0, prompt_rows * vocab + prompt_tokens, True)
    factor = torch.where(seen, repetition[:, None], 1.0)
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    # A repetition penalty near 0 (any positive one is valid) overflows a positive logit to inf, where a
    # sampler's softmax turns the row into NaN; the largest float ranks it just as high.
    logits = logits.clamp(max=torch.finfo(logits.dtype).max)
    return logits - (frequency[:, None] * counts + presence[:, None] * generated)


def reference_process(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: list[int],
    output: list[int],
    eos_ids: Collection[int],
) -> torch.Tensor:
    """One row [vocab] processed the straightforward way, as the module's docstring says (tests)."""
    out = logits.float().clone()
    for token, bias in params.logit_bias:
        out[token] += bias
    for token in set(prompt) | set(output):
        value = float(out[token])
        out[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token in set(output):
        out[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    ends = _blocked_ends(params, len(output), eos_ids)
    if ends:
        out[ends] = float("-inf")
    return out

"""Log-probabilities of sampled tokens (OpenAI's `logprobs`), for the rows of a step that asked for them.

Values come from the model's raw distribution: log_softmax of the logits before logit processing (penalties,
logit_bias, min_tokens), temperature, min-p, top-k and top-p (vLLM's default `raw_logprobs` mode), so a token's
logprob does not depend on how it was drawn. A step computes
them on the device in one batch over the rows that asked, and copies them to host memory without waiting; they
are read after the step's tokens, which already waited for the device, so a step syncs no more than before.

Prompt log-probabilities (vLLM's `prompt_logprobs`, and OpenAI's `echo` with `logprobs`) come from the same raw
distribution at every position of a prompt chunk that asked (engine/prompt_logprobs.py), each with the token's rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.uploads import upload

# The most likely tokens a request may ask for beside each sampled one: vLLM's default max_logprobs, and the
# top of OpenAI's top_logprobs range.
MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A sampled token's log-probability, and the most likely tokens at its position as (token id, logprob),
    most likely first (as many as the request asked for)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)
class StepLogprobs:
    """The log-probabilities of one step's rows that asked, on their way to host memory.

    `values` [R, 1 + K] holds each asking row's sampled-token logprob, then its K best (K: the most any row
    asked for), descending; `ids` [R, K] the tokens of those K. On CUDA both are page-locked host copies
    made without waiting, done once `copied` is.
    """

    rows: list[int]  # the asking rows' indices in the step
    counts: list[int]  # the number of top tokens each of them asked for
    values: torch.Tensor
    ids: torch.Tensor
    copied: torch.cuda.Event | None

    @staticmethod
    def compute(logits: torch.Tensor, tokens: torch.Tensor, wanted: Sequence[int | None]) -> StepLogprobs | None:
        """The log-probabilities of the rows whose `wanted` (top tokens asked for) is not None, from the step's
        `logits` [B, vocab] and sampled `tokens` [B] (on the device); None when no row asked."""
        rows = [i for i, n in enumerate(wanted) if n is not None]
        if not rows:
            return None
        counts = [int(wanted[i] or 0) for i in rows]
        if len(rows) < logits.shape[0]:
            index = upload(rows, torch.long, logits.device)
            logits, tokens = logits.index_select(0, index), tokens.index_select(0, index)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        values = logprobs.gather(1, tokens.long()[:, None])
        k = min(max(counts), logprobs.shape[-1])
        if k:
            top = logprobs.topk(k, dim=-1)  # sorted, most likely first
            values, ids = torch.cat([values, top.values], dim=1), top.indices
        else:
            ids = torch.empty((len(rows), 0), dtype=torch.long, device=logits.device)
        if not values.is_cuda:
            return StepLogprobs(rows, counts, values, ids, None)
        host_values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host_ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host_values.copy_(values, non_blocking=True)
        host_ids.copy_(ids, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return StepLogprobs(rows, counts, host_values, host_ids, copied)

    def read(self, size: int) -> list[TokenLogprobs | None]:
        """One entry per row of the step (`size` rows): its log-probabilities, None where it did not ask."""
        if self.copied is not None:
            self.copied.synchronize()  # already done once the step's tokens were read: they were copied after
        out: list[TokenLogprobs | None] = [None] * size
        for row, n, values, ids in zip(self.rows, self.counts, self.values.tolist(), self.ids.tolist(), strict=True):
            out[row] = TokenLogprobs(values[0], tuple(zip(ids[:n], values[1 : n + 1], strict=True)))
        return out


def read_logprobs(step: StepLogprobs | None, size: int) -> list[TokenLogprobs | None]:
    """`step.read(size)`, or no log-probabilities for any of the `size` rows of a step where none asked."""
    return [None] * size if step is None else step.read(size)


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """A prompt token's log-probability given the tokens before it (vLLM's `prompt_logprobs`), its rank in that
    distribution (1: the most likely), and the most likely tokens there as (token id, logprob), most likely first."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()

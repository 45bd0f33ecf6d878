"""vLLM's prompt log-probabilities: each prompt token's log-probability given the tokens before it, its rank and the
most likely tokens at its position, under the model's raw distribution (as engine/logprobs.py has the sampled
tokens').

A request that asks prefills every position of its prompt (no prefix-cache hit, no prefill graph: `StepForward`
keeps the logits of its chunks' positions as `PromptRows`); each step that has some computes them on the device in
one batch and reads them at once (`collect`), and the request's first output carries them all (`attach`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.logprobs import PromptLogprob
from engine.sequence import RequestOutput, Sequence
from engine.uploads import upload


@dataclass(eq=False)
class PromptRows:
    """Rows of a step's logits that predict prompt tokens of `seq` (a prompt chunk asking for prompt
    log-probabilities): `logits` [len(targets), vocab], row i the distribution of prompt token `targets[i]`."""

    seq: Sequence
    targets: list[int]
    logits: torch.Tensor


def _read(rows: list[PromptRows], counts: list[int]) -> list[list[PromptLogprob]]:
    """The prompt log-probabilities of each entry of `rows`, with `counts[i]` most likely tokens beside each.

    Computed on the device in one batch (log_softmax, the targets' values and ranks, top-k), read back at once:
    the step that asks waits for its logits, as its sampled tokens do."""
    logits = torch.cat([r.logits for r in rows]) if len(rows) > 1 else rows[0].logits
    targets = upload([t for r in rows for t in r.targets], torch.long, logits.device)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values = logprobs.gather(1, targets[:, None])
    ranks = (logprobs >= values).sum(dim=-1, keepdim=True)  # vLLM's: the tokens at least as likely, itself included
    k = min(max(counts), logprobs.shape[-1])
    top = logprobs.topk(k, dim=-1) if k else None
    columns = [values, ranks.to(values.dtype)] + ([top.values] if top is not None else [])
    host_values = torch.cat(columns, dim=1).tolist()
    host_ids = top.indices.tolist() if top is not None else [[] for _ in host_values]
    out: list[list[PromptLogprob]] = []
    start = 0
    for r, n in zip(rows, counts, strict=True):
        end = start + len(r.targets)
        out.append(
            [
                PromptLogprob(v[0], int(v[1]), tuple(zip(ids[:n], v[2 : 2 + n], strict=True)))
                for v, ids in zip(host_values[start:end], host_ids[start:end], strict=True)
            ]
        )
        start = end
    return out


def collect(rows: list[PromptRows]) -> None:
    """Read a step's prompt log-probabilities into their sequences (a sync, in the steps that have any)."""
    if not rows:
        return
    counts = [int(r.seq.params.prompt_logprobs or 0) for r in rows]
    for part, values in zip(rows, _read(rows, counts), strict=True):
        if part.seq.prompt_logprobs is not None:
            part.seq.prompt_logprobs.extend(values)


def attach(seq: Sequence, out: RequestOutput) -> RequestOutput:
    """`out` with `seq`'s prompt log-probabilities when it asked and this is its first output past its prefill
    (vLLM sends them once, with the first output); an error ends a request without them."""
    if not seq.wants_prompt_logprobs or seq.prompt_logprobs is None or not seq.prefill_done or out.error is not None:
        return out
    if len(seq.prompt_logprobs) != len(seq.prompt_ids) - 1:  # a bug: better no values than wrong ones
        raise RuntimeError(f"{len(seq.prompt_logprobs)} prompt log-probabilities for {len(seq.prompt_ids)} tokens")
    values, seq.prompt_logprobs = tuple(seq.prompt_logprobs), None
    return dataclasses.replace(out, prompt_logprobs=values)

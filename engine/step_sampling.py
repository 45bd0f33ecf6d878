"""A step's tokens from its logits: structured outputs' masks (engine/structured.py), logit processing
(engine/logits_processing.py), sampling (engine/sampling.py), and the log-probabilities of the rows that asked
(engine/logprobs.py), all left on the device, to be read with the tokens."""

from __future__ import annotations

from collections.abc import Collection

import torch

from engine.logits_processing import TokensInFlight, process_logits
from engine.logprobs import StepLogprobs
from engine.sampling import sample_tokens
from engine.sequence import Sequence
from engine.structured import mask_logits


def sample_step(
    order: list[Sequence], logits: torch.Tensor, eos_ids: Collection[int], previous: TokensInFlight | None = None
) -> tuple[torch.Tensor, StepLogprobs | None]:
    """The tokens of a step's rows (`order`, their `logits` [rows, vocab]) and the log-probabilities of those
    that asked; `previous`: the step still in flight, whose tokens are the newest of its sequences."""
    params = [s.params for s in order]
    # A constrained row's grammar first: penalties and biases then rank only the tokens it allows.
    masked = mask_logits(logits, order)
    processed = process_logits(masked, order, eos_ids, previous)
    tokens = sample_tokens(masked, params, [s.generator for s in order], processed)
    # From the unprocessed logits: the model's own distribution, whatever grammar, penalties or biases chose it.
    return tokens, StepLogprobs.compute(logits, tokens, [p.logprobs for p in params])

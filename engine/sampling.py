"""Token sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.logprobs import MAX_LOGPROBS
from engine.uploads import upload

# OpenAI's bound on logit_bias entries per request; each bias lies within [-100, 100].
MAX_LOGIT_BIAS = 300
# Ours on stop_token_ids (vLLM sets none): each id is checked on admission and masked under min_tokens.
MAX_STOP_TOKEN_IDS = 64
# Structured outputs (engine/structured.py): what `structured_spec` holds for each kind.
STRUCTURED_KINDS = {
    "json_object": "nothing (any JSON object)",
    "json_schema": "a JSON schema, as JSON text",
    "regex": "a regular expression",
    "choice": "a JSON array of strings",
    "grammar": "an EBNF grammar (xgrammar's, GBNF-like)",
}


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings (already validated)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # None: no log-probabilities; N: each sampled token's, with the N most likely tokens beside it (engine/logprobs.py)
    logprobs: int | None = None
    # Logit processing before sampling, greedy included (engine/logits_processing.py): OpenAI's penalties on
    # the tokens generated so far, vLLM's repetition penalty on those of the prompt and output (1 = off), and
    # biases added to chosen tokens' logits as (token id, bias) pairs, each id once.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's: drop tokens less likely than min_p times the top token (sampled rows, after temperature) ...
    min_p: float = 0.0
    # ... and no end (end-of-sequence token, stop token, stop string) before this many tokens.
    min_tokens: int = 0
    # vLLM's: sampling one of these ends the request ("stop", ignore_eos or not); the token is counted and
    # has its log-probabilities, its text is left out unless include_stop_str_in_output, which also keeps
    # the stop string that ends a request in its text.
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    # A structured output (engine/structured.py): one of STRUCTURED_KINDS ("" for none) and its spec.
    structured_kind: str = ""
    structured_spec: str = ""
    # vLLM's: each prompt token's log-probability (from the second on), with this many most likely tokens beside
    # it; None: none. With it, max_tokens may be 0: the prompt's log-probabilities alone (vLLM's echo with
    # max_tokens 0).
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the tokens seen so far change this request's logits (presence, frequency, repetition)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the bad field; with `vocab_size`, logit_bias and stop_token_ids ids are checked
        against it."""
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise ValueError(f"max_tokens must be positive (or 0 with prompt_logprobs), got {self.max_tokens}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be within [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be within [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop) or len(self.stop) > 16:
            raise ValueError("stop must hold at most 16 non-empty strings")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be within [0, {MAX_LOGPROBS}], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be within [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(
                f"repetition_penalty must be a finite number greater than 0, got {self.repetition_penalty}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be within [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be within [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        self._validate_logit_bias(vocab_size)
        self._validate_stop_token_ids(vocab_size)
        if self.structured_kind and self.structured_kind not in STRUCTURED_KINDS:
            raise ValueError(
                f"structured_kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.structured_kind!r}"
            )
        if not self.structured_kind and self.structured_spec:
            raise ValueError("structured_spec needs a structured_kind")

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) < len(ids):
            raise ValueError("logit_bias names a token id more than once")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be within [-100, 100]")
        _check_vocabulary(ids, "logit_bias", vocab_size)

    def _validate_stop_token_ids(self, vocab_size: int | None) -> None:
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"
            )
        _check_vocabulary(self.stop_token_ids, "stop_token_ids", vocab_size)


def _check_vocabulary(ids: Iterable[int], field: str, vocab_size: int | None) -> None:
    """Raise ValueError, in vLLM's words, when a token id of `field` lies outside the vocabulary."""
    outside = sorted({t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)})
    if outside:
        size = f" Vocabulary size: {vocab_size}" if vocab_size is not None else ""
        raise ValueError(f"token_id(s) {outside} in {field} contain out-of-vocab token ids.{size}")


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A private RNG for a seeded request, so that its output does not depend on batch neighbours; None
    for greedy and unseeded requests (`sample` draws unseeded rows together from torch's own generator)."""
    if params.greedy or params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


@dataclass(frozen=True, slots=True)
class ProcessedRows:
    """Rows of a step's logits that logit processing changed (engine/logits_processing.py), as a copy, so that
    the step's own logits stay the model's (log-probabilities read them): `rows` are their indices in the step,
    `index` the same on the device, `logits` [len(rows), vocab] float32 their processed values."""

    rows: list[int]
    index: torch.Tensor
    logits: torch.Tensor


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    processed: ProcessedRows | None = None,
) -> list[int]:
    """`sample_tokens`, read back: the step's tokens in one device-to-host copy."""
    return list(sample_tokens(logits, params, generators, processed).tolist())


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    processed: ProcessedRows | None = None,
) -> torch.Tensor:
    """One token per row of `logits` [B, vocab] (float32), as an int64 tensor on the logits' device; the rows
    of `processed` are drawn from its logits instead.

    Greedy rows take the argmax. The other rows are tempered and cut (min-p, top-k, then top-p) together, then
    each draws one uniform number, from its own generator if seeded (so that its tokens do not depend on
    its neighbours) and from torch's otherwise, and takes the token where that number falls in its
    cumulative distribution. Nothing is read back here: `sample` reads all tokens in one copy, so a GPU step
    waits once, not once per sampled row (bench/sampling.py), and an engine stepping ahead reads them later.
    """
    tokens = logits.argmax(dim=-1)
    if processed is not None:
        tokens = tokens.index_copy(0, processed.index, processed.logits.argmax(dim=-1))
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        device = logits.device
        index = upload(rows, torch.long, device)
        probs = _truncated_probs(_select(logits, rows, index, processed), [params[i] for i in rows])
        uniform = torch.rand(len(rows), dtype=torch.float64, device=device)
        for j, i in enumerate(rows):
            generator = generators[i]
            if generator is not None:
                uniform[j : j + 1] = torch.rand(1, dtype=torch.float64, device=device, generator=generator)
        # float64 sums: 50k float32 terms would round the last ones away. A token past the end (u * total
        # rounded up to the total itself, about 1e-16 likely) is taken as the last one.
        cumulative = probs.to(torch.float64).cumsum(-1)
        target = (uniform * cumulative[:, -1])[:, None]
        drawn = torch.searchsorted(cumulative, target, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)
        tokens = tokens.index_copy(0, index, drawn)
    return tokens


def _select(
    logits: torch.Tensor, rows: list[int], index: torch.Tensor, processed: ProcessedRows | None
) -> torch.Tensor:
    """The logits of `rows` (`index` on the device), those of `processed` rows taken from it."""
    selected = logits.index_select(0, index)
    if processed is None:
        return selected
    position = {row: j for j, row in enumerate(processed.rows)}
    pairs = [(k, position[row]) for k, row in enumerate(rows) if row in position]
    if pairs:
        at = upload(pairs, torch.long, logits.device)
        selected.index_copy_(0, at[:, 0], processed.logits.index_select(0, at[:, 1]).to(selected.dtype))
    return selected


def _truncated_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Row-wise probabilities [R, vocab] after temperature, min-p (tokens less likely than min_p times the top
    one removed), top-k (ties at the k-th score kept) and top-p (the smallest prefix whose mass reaches top_p,
    always at least the top token, ties at its last token kept): `reference_probs`, for many rows at once."""
    device, vocab = logits.device, logits.shape[-1]
    # Scores at most 0: over a tiny temperature (float32 goes down to 1e-45) logits overflowed to inf, and
    # softmax made the whole row NaN. Shifting by the row's maximum leaves softmax and the cuts unchanged.
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    scores = shifted / upload([p.temperature for p in params], torch.float32, device)[:, None]
    if any(p.min_p > 0.0 for p in params):
        # The top score is 0, so a token's probability over the top one's is exp(score): the min-p cut is a
        # cut at log(min_p), with no softmax (log 0 = -inf keeps every score of a row without min-p).
        floor = upload([p.min_p for p in params], torch.float32, device).log()[:, None]
        scores = scores.masked_fill(scores < floor, float("-inf"))
    cut = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(cut):
        k = upload(cut, torch.long, device)[:, None]
        kth = scores.topk(max(cut), dim=-1).values.gather(1, (k - 1).clamp(min=0))
        kth = torch.where(k > 0, kth, float("-inf"))  # rows without top-k keep every score
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        rows = upload(nucleus, torch.long, device)
        top_p = upload([params[i].top_p for i in nucleus], torch.float32, device)[:, None]
        probs = probs.index_copy(0, rows, _nucleus(probs.index_select(0, rows), top_p))
    return probs


_NUCLEUS_CANDIDATES = 1024


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`probs` [R, vocab] cut to each row's smallest prefix (by probability) whose mass reaches `top_p`
    [R, 1], and every token as probable as the prefix's last one.

    On the CPU, sorting the whole vocabulary was most of a step's sampling time (about 2 ms a row on a
    2-core machine, bench/sampling.py), so rows whose nucleus lies within their top 1024 tokens (most
    rows of a language model) sort only those, and a flat row is sorted whole. On a GPU that choice
    would cost a read-back of the device's answer in mid-step: there the whole vocabulary is sorted.
    """
    if not probs.is_cuda:
        values = probs.topk(min(_NUCLEUS_CANDIDATES, probs.shape[-1]), dim=-1).values  # sorted, largest first
        if not bool((values.sum(-1, keepdim=True) >= top_p).all()):
            values = torch.sort(probs, dim=-1, descending=True).values
    else:
        values = torch.sort(probs, dim=-1, descending=True).values
    # Cut at a probability, not at a position: which of the tokens tied at the edge a position keeps
    # depends on how a sort ordered them, and topk and a whole sort order ties differently, so a seeded
    # row's tokens changed with the neighbours that made it sort whole (ties are common in bfloat16 logits).
    count = (values.cumsum(-1) - values < top_p).sum(-1, keepdim=True)  # at least 1: the top token
    return probs.masked_fill(probs < values.gather(1, count - 1), 0.0)


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Reference for one row [vocab] of `_truncated_probs`, the straightforward way (tests)."""
    scores = logits / params.temperature
    if params.min_p > 0.0:
        tempered = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(tempered < params.min_p * tempered.max(), float("-inf"))
    if 0 < params.top_k < scores.shape[-1]:
        scores = scores.masked_fill(scores < torch.topk(scores, params.top_k).values[-1], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs = torch.sort(probs, descending=True).values
        count = int((sorted_probs.cumsum(-1) - sorted_probs < params.top_p).sum())
        probs = probs.masked_fill(probs < sorted_probs[count - 1], 0.0)
    return probs


def sample_one_by_one(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """How the engine sampled before `sample`: each row alone, with `torch.multinomial`, read back alone
    (bench/sampling.py times the two)."""
    out: list[int] = []
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            out.append(int(logits[row].argmax()))
        else:
            out.append(int(torch.multinomial(reference_probs(logits[row], p), 1, generator=generator)))
    return out

"""OpenAI's `logprobs` reply objects, built from the log-probabilities the engine sends with each chunk.

Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}.
Completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob, ...}, ...], "text_offset"}, each
position's top_logprobs holding the N most likely tokens and the sampled one (N + 1 where it is not among them,
as OpenAI and vLLM send it). With echo the prompt's tokens come first, the first with null for its logprob and
top_logprobs (nothing comes before it).

vLLM's prompt_logprobs: [null, {token id: {"logprob", "rank", "decoded_token"}, ...}, ...], one per prompt token,
each position's object holding the prompt token, then the N most likely tokens (vLLM's
vllm/entrypoints/openai/protocol.py and serving_completion.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.api import PromptLogprobs, TokenLogprob, TokenLogprobs

# JSON has no -inf: OpenAI and vLLM send this instead for a token the model rules out.
_FLOOR = -9999.0


class ReplyLogprobs:
    """The `logprobs` object of a reply, chunk by chunk: `add` each chunk's text and entries, and `take` the
    object for those added since the last `take` (after each chunk of a stream, or once for a whole reply).

    A completion token's text offset is the length of the text of the chunks before its own plus the lengths of
    the tokens before it in its chunk (a chunk's text is its tokens' text, but where a character spans tokens),
    so that a stream and a whole reply agree.
    """

    def __init__(self, chat: bool) -> None:
        self._chat = chat
        self._chars = 0  # characters of text added so far
        # A bare token: a prompt's first (echo), which has no log-probability.
        self._entries: list[TokenLogprobs | TokenLogprob] = []
        self._offsets: list[int] = []

    def add_prompt(self, text: str, prompt: PromptLogprobs, top: int) -> None:
        """Echo (completions): the prompt's `text` and its tokens' entries, each with the `top` most likely tokens,
        before those of any chunk."""
        self.add(text, [prompt.first, *(TokenLogprobs(e.sampled, e.top[:top]) for e in prompt.rest)])

    def add(self, text: str, entries: Sequence[TokenLogprobs | TokenLogprob]) -> None:
        if not self._chat:
            offset = self._chars
            for e in entries:
                self._offsets.append(offset)
                offset += len(_sampled(e).token)
            self._chars += len(text)
        self._entries += entries

    def take(self) -> dict[str, Any]:
        entries, offsets = self._entries, self._offsets
        self._entries, self._offsets = [], []
        if self._chat:
            return {
                "content": [
                    {**_chat_token(e.sampled), "top_logprobs": [_chat_token(t) for t in e.top]}
                    for e in entries
                    if isinstance(e, TokenLogprobs)
                ]
            }
        return {
            "tokens": [_sampled(e).token for e in entries],
            "token_logprobs": [_logprob(e.sampled) if isinstance(e, TokenLogprobs) else None for e in entries],
            "top_logprobs": [_completion_top(e) if isinstance(e, TokenLogprobs) else None for e in entries],
            "text_offset": offsets,
        }


def prompt_logprobs_reply(prompt: PromptLogprobs, top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a reply, each position with its `top` most likely tokens."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for e, rank in zip(prompt.rest, prompt.ranks, strict=True):
        # The prompt token first; where it is among the most likely too, once (vLLM's dict keeps its place).
        position = {str(e.sampled.token_id): _prompt_token(e.sampled, rank)}
        for i, t in enumerate(e.top[:top], start=1):
            position.setdefault(str(t.token_id), _prompt_token(t, i))
        out.append(position)
    return out


def _prompt_token(t: TokenLogprob, rank: int) -> dict[str, Any]:
    return {"logprob": _logprob(t), "rank": rank, "decoded_token": t.token}


def _sampled(e: TokenLogprobs | TokenLogprob) -> TokenLogprob:
    return e.sampled if isinstance(e, TokenLogprobs) else e


def _chat_token(t: TokenLogprob) -> dict[str, Any]:
    return {"token": t.token, "logprob": _logprob(t), "bytes": list(t.token_bytes)}


def _completion_top(e: TokenLogprobs) -> dict[str, float]:
    # Tokens that read the same (pieces of characters, all U+FFFD) share a key: the most likely one's value stays.
    top: dict[str, float] = {}
    for t in (*e.top, e.sampled):
        top.setdefault(t.token, _logprob(t))
    return top


def _logprob(t: TokenLogprob) -> float:
    return t.logprob if t.logprob > _FLOOR else _FLOOR  # NaN as well (not JSON either): it compares false

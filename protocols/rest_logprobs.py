"""OpenAI's `logprobs` reply objects, built from the log-probabilities the engine sends with each chunk.

Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}.
Completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob, ...}, ...], "text_offset"}, each
position's top_logprobs holding the N most likely tokens and the sampled one (N + 1 where it is not among them,
as OpenAI and vLLM send it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.api import TokenLogprob, TokenLogprobs

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
        self._entries: list[TokenLogprobs] = []
        self._offsets: list[int] = []

    def add(self, text: str, entries: Sequence[TokenLogprobs]) -> None:
        if not self._chat:
            offset = self._chars
            for e in entries:
                self._offsets.append(offset)
                offset += len(e.sampled.token)
            self._chars += len(text)
        self._entries += entries

    def take(self) -> dict[str, Any]:
        entries, offsets = self._entries, self._offsets
        self._entries, self._offsets = [], []
        if self._chat:
            return {
                "content": [
                    {**_chat_token(e.sampled), "top_logprobs": [_chat_token(t) for t in e.top]} for e in entries
                ]
            }
        return {
            "tokens": [e.sampled.token for e in entries],
            "token_logprobs": [_logprob(e.sampled) for e in entries],
            "top_logprobs": [_completion_top(e) for e in entries],
            "text_offset": offsets,
        }


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

"""Prefix caching on the slot KV cache: a request reuses the keys and values its prompt shares with earlier ones.

A KV row keeps, once its request has ended, the tokens whose keys and values it holds (the prompt and every
output token but the last, which was never fed back) and the adapter version they were computed under. A
new request whose prompt starts with those tokens under the same adapter (or both on the base model) takes
that row and prefills only the rest of its prompt. Requests share cached tokens only under the same cache salt
(vLLM's `cache_salt`; the gateway salts each tenant's requests with its name), so nobody can time another's
prompt. A prefix held in a running request's row is copied into a
free row instead (a device copy of the prefix's keys and values, against a prefill's compute). Multi-turn chats
and requests that share a system prompt are the common cases.

Lookups go through hashes of 16-token blocks, each chained from the blocks before it (as vLLM's), so a
prompt's lookup costs a dict probe per block; the chosen row's tokens are then compared, and the match is
extended token by token past its last whole block. At least one token of a prompt is always prefilled: its
logits give the first output token. Free rows are handed out empty first, then least recently used.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.kv_cache import KVCache
from engine.sequence import Sequence

# (adapter version id, 0 for the base model; cache salt): keys and values depend on the first, and are shared
# only under the same second.
CacheKey = tuple[int, str]
BLOCK = 16  # tokens per hashed block; a match shorter than one block is not worth a lookup
_CANDIDATES = 8  # rows compared token by token per lookup at most


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Where a prompt's cached prefix is: `tokens` of it in KV row `row` (None: no cached prefix), looked up
    under `key` (`cache_key`)."""

    row: int | None = None
    tokens: int = 0
    key: CacheKey = (0, "")


@dataclass(eq=False, slots=True)
class _RowContent:
    key: CacheKey = (0, "")  # the adapter version and salt its tokens were computed under (`cache_key`)
    tokens: list[int] = field(default_factory=list)  # their keys and values fill the row's first positions
    hashes: list[int] = field(default_factory=list)  # of each whole block of `tokens`, chained
    last_used: float = 0.0


def _chain(key: CacheKey, tokens: list[int], start_hash: int | None, first_block: int, last_block: int) -> list[int]:
    """The chained hashes of blocks `first_block`..`last_block - 1` of `tokens`, the one before them being
    `start_hash` (`key` seeds the first)."""
    out: list[int] = []
    previous = hash(("prefix", key)) if start_hash is None else start_hash
    for block in range(first_block, last_block):
        previous = hash((previous, *tokens[block * BLOCK : (block + 1) * BLOCK]))
        out.append(previous)
    return out


class PrefixCache:
    """Which tokens each KV row holds, and the rows a new request can start from (`lookup`, `take`).

    Disabled, it hands out rows as `KVCache.allocate` does and keeps nothing. All calls come from the engine
    thread (the scheduler's)."""

    def __init__(self, kv: KVCache, enabled: bool) -> None:
        self.kv, self.enabled = kv, enabled
        self._rows = [_RowContent() for _ in range(kv.total)]
        self._index: dict[int, set[int]] = {}  # block hash -> rows holding that prefix
        self._prompt_hashes: dict[Sequence, tuple[CacheKey, list[int]]] = {}  # seq -> (key, its blocks' hashes)
        self.queried_tokens = 0  # prompt tokens of admitted requests
        self.hit_tokens = 0  # of those, read from the cache instead of prefilled

    # -- admission ----------------------------------------------------------------------------------

    def lookup(self, seq: Sequence) -> PrefixHit:
        """The longest cached prefix of `seq`'s prompt under its adapter and salt, in a free or running row; none
        for a request asking for prompt log-probabilities, which needs the logits of every prompt position (as
        vLLM skips the prefix cache for those)."""
        key = cache_key(seq)
        if not self.enabled or seq.wants_prompt_logprobs:
            return PrefixHit(key=key)
        hashes = self._hashes_of(seq, key)
        candidates: set[int] = set()
        blocks = 0
        for h in hashes:
            rows = self._index.get(h)
            if not rows:
                break
            candidates, blocks = rows, blocks + 1
        if not blocks:
            return PrefixHit(key=key)
        prompt = seq.prompt_ids
        limit = len(prompt) - 1  # one prompt token is always prefilled, for the first output's logits
        best = PrefixHit(key=key)
        free = self.kv.free_set()
        for row in sorted(candidates, key=lambda r: r not in free)[:_CANDIDATES]:
            content = self._rows[row]
            if content.key != key or content.tokens[: blocks * BLOCK] != prompt[: blocks * BLOCK]:
                continue  # a hash collision
            end = min(limit, len(content.tokens))
            matched = min(blocks * BLOCK, end)
            while matched < end and content.tokens[matched] == prompt[matched]:
                matched += 1
            if matched > best.tokens or (matched == best.tokens and row in free and best.row not in free):
                best = PrefixHit(row, matched, key)
        return best

    def take(self, seq: Sequence, hit: PrefixHit) -> int:
        """A free KV row for `seq`, holding `hit.tokens` of its prompt: the hit's own row when free, else a free
        row the prefix is copied into. Call only while `kv.free_slots` > 0, with `seq`'s adapter as it was
        looked up."""
        assert hit.key == cache_key(seq), "looked up under another adapter version"
        self._prompt_hashes.pop(seq, None)
        if not self.enabled:
            row = self.kv.allocate()
            assert row is not None
            return row
        self.queried_tokens += len(seq.prompt_ids)
        self.hit_tokens += hit.tokens
        if hit.row is not None and hit.row in self.kv.free_set():
            self.kv.take(hit.row)
            self._truncate(hit.row, hit.tokens)
            return hit.row
        row = self._least_useful_free_row()
        self.kv.take(row)
        self._truncate(row, 0)
        if hit.row is not None and hit.tokens:
            self.kv.copy_prefix(hit.row, row, hit.tokens)
            source = self._rows[hit.row]
            self._extend(row, source.key, source.tokens[: hit.tokens])
        return row

    # -- what rows hold -----------------------------------------------------------------------------

    def record_running(self, running: list[Sequence]) -> None:
        """Note the prompt tokens the launched steps wrote into running rows (each up to `seq.prefilled`, as
        the previous schedule left it), so that requests admitted from now on can copy them."""
        if not self.enabled:
            return
        for seq in running:
            content = self._rows[seq.kv_slot]
            if len(content.tokens) < seq.prefilled:
                self._extend(seq.kv_slot, cache_key(seq), seq.prompt_ids[len(content.tokens) : seq.prefilled])

    def release(self, seq: Sequence, keep: bool) -> None:
        """`seq` (running) ends and gives its row back: what the row holds stays cached when `keep`."""
        self._prompt_hashes.pop(seq, None)
        if self.enabled:
            if keep:
                # Every output token but the last was fed back, so its keys and values are in the row.
                fed = seq.prompt_ids[: seq.prefilled] + (seq.output_ids[:-1] if seq.prefill_done else [])
                content = self._rows[seq.kv_slot]
                if len(fed) > len(content.tokens):
                    self._extend(seq.kv_slot, cache_key(seq), fed[len(content.tokens) :])
                content.last_used = time.monotonic()
            else:  # its step failed: what the row holds is unknown
                self._truncate(seq.kv_slot, 0)
        self.kv.release(seq.kv_slot)

    def forget(self, seq: Sequence) -> None:
        """`seq` left the queue without running."""
        self._prompt_hashes.pop(seq, None)

    def cached_rows(self) -> int:
        """Free rows that hold a prefix (for stats and tests)."""
        return sum(1 for row in self.kv.free_set() if self._rows[row].tokens)

    # -- internals ----------------------------------------------------------------------------------

    def _hashes_of(self, seq: Sequence, key: CacheKey) -> list[int]:
        cached = self._prompt_hashes.get(seq)
        if cached is None or cached[0] != key:  # first lookup, or the adapter was swapped meanwhile
            whole_blocks = (len(seq.prompt_ids) - 1) // BLOCK
            cached = (key, _chain(key, seq.prompt_ids, None, 0, whole_blocks))
            self._prompt_hashes[seq] = cached
        return cached[1]

    def _least_useful_free_row(self) -> int:
        free = self.kv.free_set()
        return min(free, key=lambda row: (bool(self._rows[row].tokens), self._rows[row].last_used))

    def _extend(self, row: int, key: CacheKey, tokens: list[int]) -> None:
        content = self._rows[row]
        if not content.tokens:
            content.key = key
        content.tokens.extend(tokens)
        done = len(content.hashes)
        start = content.hashes[-1] if content.hashes else None
        new = _chain(content.key, content.tokens, start, done, len(content.tokens) // BLOCK)
        for h in new:
            self._index.setdefault(h, set()).add(row)
        content.hashes.extend(new)

    def _truncate(self, row: int, length: int) -> None:
        content = self._rows[row]
        keep = length // BLOCK
        for h in content.hashes[keep:]:
            rows = self._index.get(h)
            if rows is not None:
                rows.discard(row)
                if not rows:
                    del self._index[h]
        del content.hashes[keep:]
        del content.tokens[length:]
        content.last_used = time.monotonic()


def cache_key(seq: Sequence) -> CacheKey:
    """What `seq`'s cached tokens are shared under: the adapter version it runs on (0: the base model), on which
    keys and values depend, and its cache salt."""
    return (0 if seq.adapter is None else seq.adapter.id, seq.cache_salt)

"""Continuous batching: which waiting requests join the running batch at this step.

Every step decodes all running requests and prefills as many waiting ones as KV slots, LoRA slots and the
prefill token budget (`max_num_batched_tokens`) allow. A prompt that fits the budget is prefilled whole in
one step (on CUDA, one captured graph); a longer one is prefilled in chunks over several steps, the running
requests decoding a token at each of them, so a long prompt never stalls their streams for its whole
prefill. Chunks of prompts already running come first, then new requests.

A waiting request whose adapter is still loading is skipped, never blocking the requests behind it; it
joins at the first step after its weights are ready. One that finds every LoRA slot busy does hold back the
adapter requests behind it, so that the slots drain to it in turn.

With prefix caching (`engine/prefix_cache.py`) a request whose prompt starts with tokens a KV row already
holds starts past them: only the rest of its prompt counts against the budget and is prefilled.
"""

from __future__ import annotations

from engine.kv_cache import KVCache
from engine.pool import AdapterPool
from engine.prefix_cache import PrefixCache, cache_key
from engine.sequence import SeqStatus, Sequence


class Scheduler:
    def __init__(
        self, kv: KVCache, pool: AdapterPool, max_num_batched_tokens: int, prefix: PrefixCache | None = None
    ) -> None:
        self.kv, self.pool = kv, pool
        self.prefix = prefix if prefix is not None else PrefixCache(kv, enabled=False)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        # Higher priority first, then arrival order; stable sort keeps FIFO among equals.
        self.waiting.sort(key=lambda s: -s.priority)

    def has_work(self) -> bool:
        return bool(self.running) or any(self._startable(s) for s in self.waiting)

    def schedule(self) -> dict[Sequence, int]:
        """This step's prefills: how many prompt tokens each sequence prefills, the last ones up to its
        `prefilled` (advanced here: the step runs them).

        The next chunks of running prompts come first; then waiting requests that can start now move into
        `running`. Running sequences absent from the result either decode (`seq.prefill_done`) or wait
        for a later chunk."""
        prefills: dict[Sequence, int] = {}
        budget = self.max_num_batched_tokens
        self.prefix.record_running(self.running)  # what the steps launched so far wrote
        for seq in self.running:
            left = len(seq.prompt_ids) - seq.prefilled
            if left > 0 and budget > 0:
                prefills[seq] = min(left, budget)
                seq.prefilled += prefills[seq]
                budget -= prefills[seq]
        slots_taken = False  # a request ahead found every LoRA slot busy
        held_back = False  # a request ahead waits for a step with room for its whole prompt
        for seq in list(self.waiting):
            if self.kv.free_slots == 0 or budget == 0:
                break
            hit = self.prefix.lookup(seq)
            left = len(seq.prompt_ids) - hit.tokens  # prompt tokens to prefill
            if not self._fits(left, budget, held_back):
                held_back = held_back or self._waits_whole(seq, left, budget)
                continue
            if not self._startable(seq):
                continue
            if seq.adapter is not None:
                # Admitted past a request that waits for a slot, later requests for the resident adapters
                # would keep them busy: under steady traffic for those, it would never start.
                slot = None if slots_taken else self.pool.acquire(seq.adapter)
                if slot is None:
                    # Every LoRA slot busy with running requests; or, since `_startable` looked, the version was
                    # replaced (a swap ending on a loader thread) or its host copy dropped: nothing about slots.
                    slots_taken = slots_taken or not (seq.adapter.retired or seq.adapter.weights is None)
                    continue
                seq.lora_slot = slot
            if hit.key != cache_key(seq):  # swapped to a new version since the lookup: its own keys
                hit = self.prefix.lookup(seq)
                left = len(seq.prompt_ids) - hit.tokens
            seq.kv_slot = self.prefix.take(seq, hit)
            seq.status = SeqStatus.RUNNING
            self.waiting.remove(seq)
            self.running.append(seq)
            prefills[seq] = min(left, budget)
            seq.cached_tokens = hit.tokens
            seq.prefilled = hit.tokens + prefills[seq]
            budget -= prefills[seq]
        return prefills

    def prompts_next(self) -> bool:
        """Whether the next `schedule` may take in prompt tokens: a running prompt's next chunk, or a waiting
        request that could start (a free KV slot, its adapter's current version in memory). Changes nothing,
        and starts no load, unlike `_startable`. It may say yes for a step that will only decode: a request
        whose adapter finds every LoRA slot busy, or a prompt held back for a later step, still counts."""
        if any(s.prefilled < len(s.prompt_ids) for s in self.running):
            return True
        return self.kv.free_slots > 0 and any(self._usable(s) for s in self.waiting)

    def _usable(self, seq: Sequence) -> bool:
        """Whether `seq`'s adapter (its current version) has its weights in memory, or it has none."""
        if seq.adapter is None:
            return True
        current = self.pool.current(seq.adapter)
        return current is not None and current.weights is not None

    def upcoming(self) -> list[Sequence]:
        """The waiting requests the next `schedule` would try to admit, in its order: as many as there are
        free KV slots, within the prefill token budget. Changes nothing (their adapters may still load)."""
        picked: list[Sequence] = []
        chunks_left = sum(len(s.prompt_ids) - s.prefilled for s in self.running)
        budget = max(0, self.max_num_batched_tokens - chunks_left)
        held_back = False
        for seq in self.waiting:
            if len(picked) >= self.kv.free_slots or budget == 0:
                break
            left = len(seq.prompt_ids) - self.prefix.lookup(seq).tokens
            if self._fits(left, budget, held_back):
                picked.append(seq)
                budget -= min(left, budget)
            else:
                held_back = held_back or left <= self.max_num_batched_tokens
        return picked

    def _fits(self, prompt_len: int, budget: int, held_back: bool) -> bool:
        """Whether a prompt (its `prompt_len` tokens to prefill) starts with `budget` tokens left in this step:
        whole, or, when longer than any
        step's budget, as its first chunk. One that would fit a later step whole waits for it rather than
        being cut (a whole prompt prefills as one captured graph on CUDA); once one waits so (`held_back`),
        prompts behind it start no chunks past it, as their chunks would take the budget ahead of it step
        after step."""
        return prompt_len <= budget or (prompt_len > self.max_num_batched_tokens and not held_back)

    def _waits_whole(self, seq: Sequence, left: int, budget: int) -> bool:
        """Whether `seq`, refused by `_fits`, waits for a step with room for its whole prompt (`left` tokens to
        prefill) and could start otherwise: it then holds back the chunks of the prompts behind it."""
        return budget < left <= self.max_num_batched_tokens and self._startable(seq)

    def finish(self, seq: Sequence, keep_kv: bool = True) -> None:
        """Release everything `seq` holds; it may be waiting or running. Its KV row stays cached for later
        prompts (prefix caching) unless not `keep_kv` (its step failed)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.prefix.release(seq, keep_kv)
            if seq.adapter is not None:
                self.pool.release(seq.adapter, len(seq.output_ids))
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            self.prefix.forget(seq)
            if seq.adapter is not None and all(s.adapter is not seq.adapter for s in self.waiting):
                self.pool.unwanted(seq.adapter)  # aborted or failed while it waited: nobody waits for it now
        seq.status = SeqStatus.FINISHED

    def _startable(self, seq: Sequence) -> bool:
        if seq.adapter is None:
            return True
        current = self.pool.current(seq.adapter)  # replaced while the request waited: the new version
        if current is None:
            return False  # unloaded: the engine ends the request (`LLMEngine._reap`)
        seq.adapter = current
        return self.pool.ready(current)

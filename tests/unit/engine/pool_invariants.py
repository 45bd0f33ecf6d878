"""The adapter pool's invariants, checked by the randomized tests after every operation."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from engine.eviction import DecayedFrequencyPolicy
from engine.pinned_arena import PinnedArena
from engine.pool import AdapterPool, AdapterVersion
from engine.sequence import Sequence

Tensors = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class PoolInvariants:
    """Checks `pool` against the running requests; `refs` holds each good adapter file's weights (as read
    alone), `arena` the arena the loader puts images in, if any."""

    def __init__(self, pool: AdapterPool, refs: dict[Path, Tensors], arena: PinnedArena | None = None) -> None:
        self.pool, self.refs, self.arena = pool, refs, arena
        self.versions: list[AdapterVersion] = []  # every version seen so far
        self._seen: set[int] = set()
        self._pinned_resident: set[AdapterVersion] = set()
        self.arena_empty = arena.free_pages if arena is not None else 0

    def saw(self, versions: Iterable[AdapterVersion | None]) -> None:
        for v in versions:
            if v is not None and id(v) not in self._seen:
                self._seen.add(id(v))
                self.versions.append(v)

    def check(self, running: list[Sequence]) -> None:
        """Slots held by one version each, with that version's weights; `active` = running requests; a running
        request keeps its slot; pinned current versions stay resident; retired idle versions hold no memory;
        the eviction policy and the arena agree with the slots and the host copies."""
        with self.pool._lock:  # loads may end on other threads meanwhile
            self._check(running)

    def _check(self, running: list[Sequence]) -> None:
        pool = self.pool
        stacks = pool._stacks
        current = set(pool._by_name.values())
        staged = set(pool._staged.values())
        self.saw([*current, *staged, *pool._slots, *(s.adapter for s in running)])
        for slot, holder in enumerate(pool._slots):
            if holder is None:
                assert stacks.slot_ranks[slot] == 0, f"empty slot {slot} still applies an adapter"
                continue
            assert holder.slot == slot, f"slot {slot} holds {holder.key}, which thinks it is in {holder.slot}"
            assert holder.weights is not None, f"{holder.key} holds a slot without host weights"
            self.assert_slot_holds(slot, holder)
        for v in self.versions:
            users = sum(1 for s in running if s.adapter is v)
            assert v.active == users, f"{v.key}: active {v.active}, {users} running requests hold it"
            if v.slot is not None:
                assert pool._slots[v.slot] is v, f"{v.key} thinks it holds slot {v.slot}"
            if v not in current and v not in staged:
                assert v.retired, f"{v.key} is neither current, staged nor retired"
            else:
                assert not v.retired, f"retired {v.key} is still current or staged"
            if v.retired and v.active == 0:
                assert v.slot is None and v.weights is None, f"retired idle {v.key} still holds memory"
        for seq in running:
            assert seq.adapter is None or seq.adapter.slot == seq.lora_slot, (
                f"{seq.request_id}'s slot {seq.lora_slot} was taken while it ran"
            )
        for v in self._pinned_resident:
            if v.pinned and not v.retired:
                assert v.slot is not None, f"pinned {v.key} was evicted"
        self._pinned_resident = {v for v in current if v.pinned and v.slot is not None}
        assert all(v.slot is not None for v in pool._unclaimed)
        in_host = [v for v in current if v.weights is not None]
        if len(in_host) > pool._host_capacity:  # over capacity only while no copy can go (the last loaded aside)
            spare = [v.key for v in self.host_only() if not v.wanted]
            assert len(spare) <= 1, f"{len(in_host)} host copies, capacity {pool._host_capacity}, {spare} could go"
        if isinstance(pool._eviction, DecayedFrequencyPolicy):  # the policy's resident keys are those in slots
            assert pool._eviction._resident == {v.key for v in pool._slots if v is not None}
        self.check_arena()

    def assert_slot_holds(self, slot: int, version: AdapterVersion) -> None:
        """The slot's stacked weights are exactly those of `version`'s file (not another version's)."""
        stacks = self.pool._stacks
        ref = self.refs[version.spec.path]
        r = version.spec.rank
        assert stacks.slot_ranks[slot] == r
        assert stacks.slot_modules[slot] == version.spec.modules
        for (layer, module), (a, b) in ref.items():
            assert torch.equal(stacks.a[(layer, module)][slot, :r], a.to(stacks.dtype)), f"slot {slot}: A"
            assert torch.equal(stacks.b[(layer, module)][slot, :, :r], b.to(stacks.dtype)), f"slot {slot}: B"

    def check_arena(self) -> None:
        """Extents handed out = images the pool's versions hold: none leaked, none given back twice."""
        if self.arena is None:
            return
        taken = self.arena._taken
        held = [
            v.weights.packed
            for v in self.versions
            if v.weights is not None and v.weights.packed is not None and v.weights.packed.data_ptr() in taken
        ]
        assert len(held) == len(taken), "an arena extent is held by no version (leaked)"
        pages = sum(taken[t.data_ptr()][1] for t in held)
        assert self.arena.free_pages == self.arena_empty - pages

    def host_only(self) -> list[AdapterVersion]:
        """Current versions holding host weights the host tier could drop (no slot, no pin, no request)."""
        return [
            v
            for v in self.pool._by_name.values()
            if v.weights is not None and v.slot is None and not v.pinned and v.active == 0
        ]

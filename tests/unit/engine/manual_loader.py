"""An adapter loader whose loads start and end only when a test says so: one seed, one interleaving."""

from __future__ import annotations

import random
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.adapters import AdapterSpec, load_adapter, load_layers_into, read_spec
from engine.config import ModelArch
from engine.lora import AdapterWeights, SlotLayout, image_groups
from engine.pinned_arena import PinnedArena


@dataclass(eq=False)
class _Load:
    spec: AdapterSpec
    future: Future[AdapterWeights]
    running: bool = False


class ManualLoader:
    """`AdapterLoader` whose loads stay queued until `start` (no longer cancellable: a worker reads the file)
    and `finish` (the worker's outcome); with `arena` and fused stacks' `layout`, images go into extents of
    the arena, as loader processes write them."""

    def __init__(self, dtype: torch.dtype, layout: SlotLayout | None, arena: PinnedArena | None = None) -> None:
        self._dtype, self._layout, self._arena = dtype, layout, arena
        self._loads: list[_Load] = []
        self.submitted = 0
        # When set, each check first starts a random queued load with this chance: a worker may take a load
        # submitted ahead of the check (`AdapterPool._load_ahead`) while the check runs.
        self.start_during_check: tuple[random.Random, float] | None = None

    def check(self, path: Path, arch: ModelArch, max_rank: int) -> AdapterSpec:
        if self.start_during_check is not None:
            rng, chance = self.start_during_check
            if rng.random() < chance:
                self.start(rng)
        return read_spec(path, arch, max_rank)

    def submit(self, spec: AdapterSpec) -> Future[AdapterWeights]:
        future: Future[AdapterWeights] = Future()
        self._loads.append(_Load(spec, future))
        self.submitted += 1
        return future

    def close(self) -> None:
        self._loads.clear()

    @property
    def pending(self) -> int:
        """Loads submitted and not yet ended (the pool's cancels end them too)."""
        self._loads = [load for load in self._loads if not load.future.done()]
        return len(self._loads)

    def start(self, rng: random.Random) -> bool:
        """Mark a random queued load as running; False if none is queued."""
        queued = [load for load in self._loads if not load.running and not load.future.done()]
        if not queued:
            return False
        load = rng.choice(queued)
        load.running = load.future.set_running_or_notify_cancel()
        return True

    def finish(self, rng: random.Random) -> bool:
        """End a random pending load with the file's weights or its error; False if none is pending."""
        if not self.pending:
            return False
        load = self._loads.pop(rng.randrange(len(self._loads)))
        if not load.running and not load.future.set_running_or_notify_cancel():
            return True  # cancelled meanwhile
        try:
            weights = self._read(load.spec)
        except Exception as exc:
            load.future.set_exception(exc)
        else:
            load.future.set_result(weights)
        return True

    def finish_all(self, rng: random.Random) -> None:
        while self.finish(rng):
            pass

    def _read(self, spec: AdapterSpec) -> AdapterWeights:
        if self._arena is None or self._layout is None:
            return load_adapter(spec, self._dtype, pin=False, layout=self._layout)
        groups = image_groups(spec.modules)
        image = self._arena.take(self._layout.image_size(groups, spec.rank), self._dtype)
        if image is None:  # the arena is full: an image of its own, as `adapter_loader._own` falls back to
            return load_adapter(spec, self._dtype, pin=False, layout=self._layout)
        try:
            load_layers_into(spec, self._dtype, self._layout, image, range(self._layout.num_layers))
        except BaseException:
            self._arena.give_back(image)
            raise
        return AdapterWeights(spec.rank, spec.scaling, spec.modules, {}, image, groups)

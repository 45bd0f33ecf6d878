"""Adapter residency: registered (disk) -> host memory -> a LoRA slot, with eviction and background loads.

Thread model: gRPC handlers register adapters; the engine thread acquires and releases slots; a small
executor reads weights from disk. One lock guards the tables; weight copies into slots happen on the
engine thread only: when a step admits a request (`acquire`), or earlier, while the GPU runs the step
before it (`fill_ahead`).

Versions make hot swap safe: registering a name again creates a new `AdapterVersion` that loads in the
background while the old one keeps serving; once the new weights are in host memory the name switches to
them in one step (a new version that fails to load never replaces a working one). Requests already holding
the old version finish on it, and its slot is freed when the last of them releases it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.adapter_loader import AdapterLoader, ThreadLoader
from engine.adapters import AdapterError, AdapterSpec
from engine.config import ModelArch
from engine.eviction import DecayedFrequencyPolicy, EvictionPolicy
from engine.lora import AdapterWeights, LoRAStacks, image_groups
from engine.pinned_arena import PinnedArena


class AdapterState(enum.Enum):
    REGISTERED = "registered"  # known, weights on disk only
    LOADING = "loading"  # disk -> host read in flight
    HOST = "host"  # weights in host memory
    RESIDENT = "resident"  # weights in a LoRA slot
    FAILED = "failed"  # the last load failed; `error` says why


_ids = itertools.count(1)
# Versions whose device image (`AdapterWeights.device_packed`) the pool keeps for a fill expected soon: each is
# about 76 MiB at Llama-7B dims (rank 16, all seven projections), and many requests can wait for cold adapters.
DEVICE_IMAGES_KEPT = 2


@dataclass(eq=False)
class AdapterVersion:
    """One registered adapter version; mutated under the pool's lock."""

    name: str
    spec: AdapterSpec
    pinned: bool
    id: int = field(default_factory=lambda: next(_ids))
    weights: AdapterWeights | None = None
    loading: Future[AdapterWeights] | None = None
    error: str | None = None
    failed_at: float = 0.0  # when `error` was set: the negative cache holds it for a while
    slot: int | None = None
    active: int = 0  # running requests using the slot
    retired: bool = False  # replaced or unloaded; freed once idle
    last_used: float = 0.0
    wanted: bool = False  # a request waits for it (`ready`) and has not acquired it since
    requests_served: int = 0
    tokens_generated: int = 0
    settled: threading.Event = field(default_factory=threading.Event)  # set when a load ends (any outcome)
    settled_at: float | None = None  # time.monotonic() when its last load ended (any outcome)

    @property
    def key(self) -> str:
        """Identity for the eviction policy: per version, since old and new may both hold slots in a swap."""
        return f"{self.name}#{self.id}"

    @property
    def state(self) -> AdapterState:
        if self.slot is not None:
            return AdapterState.RESIDENT
        if self.weights is not None:
            return AdapterState.HOST
        if self.loading is not None:
            return AdapterState.LOADING
        return AdapterState.FAILED if self.error else AdapterState.REGISTERED


@dataclass(frozen=True, slots=True)
class AdapterCacheStats:
    """The pool's counters since it started (`AdapterPool.cache_stats`)."""

    slot_hits: int
    slot_misses: int
    evictions: int
    loads: int
    fills_ahead: int


class AdapterPool:
    """Adapters by name, their host copies and their slots in `stacks`."""

    def __init__(
        self,
        arch: ModelArch,
        stacks: LoRAStacks,
        dtype: torch.dtype,
        host_capacity: int,
        eviction: EvictionPolicy | None = None,
        loader: AdapterLoader | None = None,
        arena: PinnedArena | None = None,
    ) -> None:
        """`arena`: where the loader puts host images (if anywhere); the pool gives them back when it drops
        an adapter from host memory."""
        self._arch, self._stacks, self._arena, self._dtype = arch, stacks, arena, dtype
        # Every slot holds up to max_rank whatever the adapter's rank, so slots are sized 1 for the policy.
        self._eviction: EvictionPolicy = eviction if eviction is not None else DecayedFrequencyPolicy()
        self._host_capacity = host_capacity
        self._lock = threading.RLock()  # a load may finish inside _start_load
        self._by_name: dict[str, AdapterVersion] = {}
        self._staged: dict[str, AdapterVersion] = {}  # new versions loading while the current one serves
        self._retired: list[AdapterVersion] = []
        self._slots: list[AdapterVersion | None] = [None] * stacks.slots
        # Filled ahead for a waiting request that has not acquired them yet: other fills ahead leave them be.
        self._unclaimed: set[AdapterVersion] = set()
        # Versions a hot swap made current while their predecessor held a slot: the next fill-ahead pass copies
        # them into one, as if a request for them were next in line (`fill_ahead`).
        self._successors: list[AdapterVersion] = []
        self._loader: AdapterLoader = loader if loader is not None else ThreadLoader(dtype, stacks.layout)
        self.on_loaded: list[Callable[[], None]] = []
        self.loads_started = 0
        self.evictions = 0
        self.slot_hits = 0  # acquires that found the version already in a slot
        self.slot_misses = 0  # acquires that needed a fill, their own or one ahead for them (`fill_ahead`)
        self.fills_ahead = 0
        self.negative_ttl_s = 10.0
        # A hot swap's new version starts loading beside its check (`_load_ahead`); bench/engine_gpu_e2e.py
        # turns it off to compare.
        self.load_ahead = True

    def close(self) -> None:
        self._loader.close()

    # -- registration (any thread) -------------------------------------------------------------------

    def register(self, name: str, path: str | Path, pinned: bool = False) -> AdapterVersion:
        """Validate the adapter (raises AdapterError; the loader's `check`) and make it the version of `name`.

        A first version is current at once (its requests wait for its load). A replacement is staged: the
        current version keeps serving until the new one's weights are loaded, then the name switches.
        """
        ahead = self._load_ahead(name, Path(path))
        started = ahead[1] if ahead is not None else None  # until `_start_load` takes it: abandoned on every exit
        try:
            spec = self._loader.check(Path(path), self._arch, self._stacks.max_rank)
            if ahead is not None and ahead[0] != spec:  # its rank or projections changed: the wrong image
                self._abandon(ahead[1])
                started = None
            version = AdapterVersion(name=name, spec=spec, pinned=pinned)
            with self._lock:
                if pinned:
                    self._check_pin_room(name)
                old = self._by_name.get(name)
                # The latest registration wins, the current path's too: a replacement still loading must not
                # take the name over once it has loaded.
                superseded = self._staged.pop(name, None)
                if superseded is not None:
                    self._retire(superseded)
                if old is not None and old.spec.path == spec.path and old.error is None:
                    unpinned, old.pinned = old.pinned and not pinned, pinned
                    if unpinned:  # its host copy may have to go now, like any other beyond the capacity
                        self._trim_host(keep=None)
                    return old
                if old is not None and old.error is None:
                    self._staged[name] = version
                else:
                    self._by_name[name] = version
                    if old is not None:
                        self._retire(old)
                self._start_load(version, started)
                started = None
            return version
        finally:
            if started is not None:
                self._abandon(started)

    def _load_ahead(self, name: str, path: Path) -> tuple[AdapterSpec, Future[AdapterWeights]] | None:
        """For a hot swap: the new version's load, started before its check, with the serving version's rank
        and projections (what a new version of an adapter mostly keeps), and the spec it was started with.

        With loader processes the check is a round trip to the checker process, 3-5 ms on an H100 host, and a
        32-layer Llama-7B load takes 15-20 ms after it (bench/RESULTS-gpu.md, stop 33): run side by side, the
        swap waits for the longer of the two. `register` keeps the load if the check finds the same spec, and
        abandons it otherwise: its rank, scaling or projections changed (a load of the wrong rank fails on
        its own, harmlessly)."""
        with self._lock:
            old = self._by_name.get(name)
            if not self.load_ahead or old is None or old.error is not None or old.spec.path == path:
                return None
            guess = dataclasses.replace(old.spec, path=path)
            self._make_arena_room(guess)
            try:
                future = self._loader.submit(guess)
            except Exception:  # no loader could take it now: the load after the check will say why
                return None
            return guess, future

    def _abandon(self, future: Future[AdapterWeights]) -> None:
        """Drop a load started ahead of its check; its image goes back to the arena once it exists."""
        if future.cancel():
            return

        def give_back(done: Future[AdapterWeights]) -> None:
            if done.cancelled() or done.exception() is not None:
                return
            if self._arena is not None:
                done.result().give_back_host_image(self._arena)

        future.add_done_callback(give_back)

    def _check_pin_room(self, name: str) -> None:
        # Pinned adapters are never evicted: were every slot to hold one, requests for any other adapter would
        # wait for a slot forever. One slot always stays for the unpinned.
        others = {n for table in (self._by_name, self._staged) for n, v in table.items() if v.pinned and n != name}
        if len(others) >= self._stacks.slots - 1:
            raise AdapterError(
                f"cannot pin {name!r}: {len(others)} adapters are pinned already and one of the engine's "
                f"{self._stacks.slots} LoRA slots stays for unpinned adapters (raise --lora-slots, or unpin one)"
            )

    def unregister(self, name: str) -> bool:
        with self._lock:
            staged = self._staged.pop(name, None)
            if staged is not None:
                self._retire(staged)
            version = self._by_name.pop(name, None)
            if version is None:
                return False
            self._retire(version)
            return True

    def lookup(self, name: str) -> AdapterVersion | None:
        with self._lock:
            return self._by_name.get(name)

    def current(self, version: AdapterVersion) -> AdapterVersion | None:
        """The version a request holding `version` should start on: `version` itself, or, once a hot swap
        retired it, the name's current version (None if the name was unloaded). A retired version is dropped
        once idle; a request that has not started must not load it again."""
        with self._lock:
            return self._by_name.get(version.name) if version.retired else version

    def versions(self) -> list[AdapterVersion]:
        with self._lock:
            return list(self._by_name.values())

    def cache_stats(self) -> AdapterCacheStats:
        with self._lock:
            return AdapterCacheStats(
                self.slot_hits, self.slot_misses, self.evictions, self.loads_started, self.fills_ahead
            )

    def wait_loaded(self, version: AdapterVersion, timeout: float | None = None) -> None:
        """Block until `version`'s load has ended and taken effect (a staged version is then current);
        raises AdapterError if the load failed, TimeoutError if it is still running after `timeout`."""
        with self._lock:
            loading = version.loading is not None
        if loading and not version.settled.wait(timeout):
            raise TimeoutError(f"adapter {version.name!r} still loading after {timeout} s")
        if version.error:
            raise AdapterError(version.error)

    # -- engine thread ------------------------------------------------------------------------------

    def ready(self, version: AdapterVersion) -> bool:
        """Whether `version` can get a slot now; starts its load if its weights are not in memory."""
        with self._lock:
            version.wanted = True
            if version.weights is None and version.loading is None and not self._recently_failed(version):
                self._start_load(version)
            return version.weights is not None

    def failure(self, version: AdapterVersion) -> str | None:
        """Why `version` cannot load, while its failure is in the negative cache (else None)."""
        with self._lock:
            return version.error if self._recently_failed(version) else None

    def _recently_failed(self, version: AdapterVersion) -> bool:
        # A missing or broken file is not retried on every request: disk reads would pile up behind a
        # client that keeps asking. After the TTL one new request tries again (the file may be fixed).
        return version.error is not None and time.monotonic() - version.failed_at < self.negative_ttl_s

    def unwanted(self, version: AdapterVersion) -> None:
        """No request waits for `version` any more (its last waiting one ended before it started): the host tier
        stops keeping it ahead of the others (`_trim_host`)."""
        with self._lock:
            version.wanted = False
            self._drop_device_image(version)

    def acquire(self, version: AdapterVersion) -> int | None:
        """The slot holding `version` (loading it into one, evicting an idle adapter if needed), or None: every
        slot is busy, or `version` was retired (replaced or unloaded) since the caller looked it up."""
        with self._lock:
            if version.retired:  # a swap that ended on a loader thread meanwhile: its replacement starts instead
                return None
            if version.slot is None:
                if version.weights is None:
                    return None
                slot = self._free_slot(spare=self._unclaimed)
                if slot is None:  # only adapters filled ahead for other requests are idle: take one of those
                    slot = self._free_slot()
                if slot is None or not self._fill(slot, version):
                    return None
                self.slot_misses += 1
            elif version in self._unclaimed:
                self.slot_misses += 1  # filled ahead for this very request: a miss whose copy nobody waited for
            else:
                self.slot_hits += 1
            self._unclaimed.discard(version)
            self._eviction.on_access(version.key, 1, time.monotonic())
            version.wanted = False
            version.active += 1
            version.requests_served += 1
            version.last_used = time.monotonic()
            return version.slot

    def fill_ahead(self, upcoming: list[AdapterVersion], most: int) -> int:
        """Copy up to `most` of `upcoming` (the adapters of the requests next to join, in order) into slots
        before a step acquires them; returns how many it copied.

        The engine calls this after launching a step and before waiting for its tokens, so the fills' CPU
        work overlaps the GPU's, and their copies are done by the time the next step prefills the requests:
        a cold request then joins the batch like a warm one instead of lengthening the step it joins. Takes
        free slots or idle adapters', never the slot of an upcoming request's adapter.

        A hot swap's new version, whose predecessor held a slot, counts as upcoming in the first pass after the
        swap (after the requests' own adapters): the first request on it then waits for no copy (at Llama-7B
        dims, 16 layers, a 38 MiB image takes 0.74 ms host to GPU). After that pass it is an idle adapter like
        any other, which the eviction policy may take.
        """
        # The engine calls this every step: with nothing to fill, it returns without the lock. A successor a
        # loader thread appends meanwhile is seen by the next step's call.
        if not upcoming and not self._successors:
            return 0
        with self._lock:
            successors, self._successors = self._successors, []
            upcoming = upcoming + [v for v in successors if not v.retired and v not in upcoming]
            self._unclaimed.intersection_update(upcoming)  # a request that left the queue holds no fill
            spare = set(upcoming)  # an upcoming request's adapter, resident or filled ahead, stays
            filled = 0
            for version in upcoming:
                if filled == most:
                    break
                if version.slot is not None or version.weights is None:
                    continue
                slot = self._free_slot(spare=spare)
                if slot is None:
                    break
                if not self._fill(slot, version):
                    continue
                self._unclaimed.add(version)
                filled += 1
            for version in successors:  # not filled in their one pass: idle adapters now, like any other
                if version.slot is None:
                    self._drop_device_image(version)
            self.fills_ahead += filled
            return filled

    def release(self, version: AdapterVersion, tokens: int) -> None:
        with self._lock:
            version.active -= 1
            version.tokens_generated += tokens
            version.last_used = time.monotonic()
            if version.retired and version.active == 0:
                self._drop(version)

    # -- internals (lock held) ----------------------------------------------------------------------

    def _start_load(self, version: AdapterVersion, started: Future[AdapterWeights] | None = None) -> None:
        """Load `version` in the background (`started`: its load, already submitted by `_load_ahead`)."""
        self.loads_started += 1
        version.error = None
        version.settled.clear()
        version.settled_at = None
        try:
            if started is not None:
                future = started
            else:
                self._make_arena_room(version.spec)
                future = self._loader.submit(version.spec)
        except Exception as exc:
            # No loader could take it (loader processes that cannot start again): a failed load, held in the
            # negative cache. Raised, it left `ready` in the engine's loop, and `register` with the version in
            # place but nothing loading it.
            future = Future()
            future.set_exception(exc)
        version.loading = future
        future.add_done_callback(functools.partial(self._loaded, version))

    def _loaded(self, version: AdapterVersion, future: Future[AdapterWeights]) -> None:
        try:
            with self._lock:
                version.loading = None
                if future.cancelled() and version.retired:
                    return
                # Only a retired version's load is cancelled on purpose (`_retire`). Any other cancel (none is
                # known) is a failed load: ignored, it left a staged version staged and its waiters waiting.
                exc = future.exception() if not future.cancelled() else RuntimeError("the load was cancelled")
                staged = self._staged.get(version.name) is version
                if exc is not None:
                    version.error = str(exc) if isinstance(exc, AdapterError) else f"load failed: {exc!r}"
                    version.failed_at = time.monotonic()
                    if staged:  # the working version stays current
                        del self._staged[version.name]
                        version.retired = True
                    return
                # A retired version still loads: requests admitted before the swap finish on it.
                version.weights = future.result()
                fill_soon = version.wanted  # a request waits for it
                if staged:
                    del self._staged[version.name]
                    old = self._by_name.get(version.name)
                    self._by_name[version.name] = version
                    if old is not None:
                        if old.slot is not None:  # in use lately: its next request should find it in a slot
                            self._successors.append(version)
                            fill_soon = True
                        self._retire(old)
                if not fill_soon or version.retired or self._device_images_kept() > DEVICE_IMAGES_KEPT:
                    self._drop_device_image(version)
                if version.retired and version.active == 0:
                    self._drop(version)  # replaced or unloaded while loading, and nobody waits for it
                else:
                    self._trim_host(keep=version)
        finally:
            version.settled_at = time.monotonic()
            version.settled.set()
            # Whatever the outcome: the engine wakes to start the requests waiting for the load, or to end
            # them with its error (`LLMEngine._reap`).
            for callback in self.on_loaded:
                callback()

    def _fill(self, slot: int, version: AdapterVersion) -> bool:
        """Copy `version` into the free `slot`; False if its weights do not fit the slots, which fails it."""
        assert version.weights is not None
        try:
            self._stacks.set_lora(slot, version.weights)
        except Exception as exc:
            # Weights that loaded but do not fit (a file rewritten for another base model since its check,
            # on loose stacks) fail their adapter like a failed load: raised into the engine's step, they
            # failed its running requests at every step, and the adapter's own requests never ended.
            self._stacks.reset_lora(slot)  # the evicted adapter's table entry must not stay behind
            version.error = f"cannot copy into a slot: {exc!r}"
            version.failed_at = time.monotonic()
            self._discard_weights(version)  # once out of the negative cache, a request reads the file again
            return False
        except BaseException:
            self._stacks.reset_lora(slot)
            raise
        self._slots[slot] = version
        version.slot = slot
        self._drop_device_image(version)  # later fills read the host image
        self._eviction.on_insert(version.key, 1, time.monotonic())
        # The adapter this fill evicted (if any) is now a host copy the host tier may drop: trimmed only as
        # loads ended, an evicted one stayed beyond the capacity for as long as no load ended.
        self._trim_host(keep=version)
        return True

    def _free_slot(self, spare: set[AdapterVersion] | None = None) -> int | None:
        """An empty slot, or the slot of the idle adapter the policy evicts (never one in `spare`)."""
        for slot, holder in enumerate(self._slots):
            if holder is None:
                return slot
        idle = {
            v.key: slot
            for slot, v in enumerate(self._slots)
            if v is not None and v.active == 0 and not v.pinned and not (spare and v in spare)
        }
        key = self._eviction.victim(idle, time.monotonic())
        if key is None:
            return None
        slot = idle[key]
        evicted = self._slots[slot]
        assert evicted is not None
        self._eviction.on_remove(key)
        evicted.slot = None
        self._slots[slot] = None
        self._unclaimed.discard(evicted)
        # No reset: the fill that follows (`acquire`) replaces the slot whole, table entry included, and no
        # step reads it meanwhile (its adapter was idle). Clearing it first cost every slot miss another table
        # write on the engine's thread.
        self.evictions += 1
        return slot

    def _trim_host(self, keep: AdapterVersion | None) -> None:
        # `keep` was just loaded for requests that wait for it (or filled into a slot): dropping it would only
        # start its load again. Adapters others wait for (`wanted`) go last: loaded and not used yet, they
        # ranked as the least recent, and each load for a waiting request dropped another's, which the next
        # step loaded again, while adapters nobody had asked for since stayed.
        in_host = [v for v in self._by_name.values() if v.weights is not None]
        excess = len(in_host) - self._host_capacity
        if excess <= 0:
            return
        for v in sorted(in_host, key=lambda v: (v.wanted, v.last_used)):
            if excess <= 0:
                break
            if v is not keep and self._droppable_host_copy(v):
                self._discard_weights(v)
                excess -= 1

    @staticmethod
    def _droppable_host_copy(v: AdapterVersion) -> bool:
        """Whether `v`'s host copy may go: not in a slot, not pinned, no request running on it."""
        return v.weights is not None and v.slot is None and not v.pinned and v.active == 0

    def _make_arena_room(self, spec: AdapterSpec) -> None:
        # A load whose image finds no room in the shared arena goes to a new pinned allocation: a cudaHostAlloc,
        # which holds up the device's streams for milliseconds. At Llama-7B dims (38 MiB images) a 1 GiB arena
        # holds 26, fewer than the host tier's 64, and the benchmark's first engine, whose cold joins loaded
        # adapters 27 onwards, measured others' p99 10-12x steady during them, where a second engine in the same
        # process, whose fallbacks torch's pinned cache already held, measured 2.1x. So the arena also bounds the
        # host tier in bytes: idle host copies in it make room first, least recently used first, as `_trim_host`
        # would drop them. A first engine then measured 1.57x (one H100, bench/RESULTS-gpu.md, stop 26).
        arena, layout = self._arena, self._stacks.layout
        if arena is None or layout is None:
            return
        numel = layout.image_size(image_groups(spec.modules), spec.rank)
        if arena.fits(numel, self._dtype):
            return
        idle = [
            v
            for v in self._by_name.values()
            if self._droppable_host_copy(v)
            and not v.wanted
            and v.weights is not None
            and v.weights.packed is not None
            and arena.holds(v.weights.packed)
        ]
        for v in sorted(idle, key=lambda v: v.last_used):
            self._discard_weights(v)
            if arena.fits(numel, self._dtype):
                return

    def _retire(self, version: AdapterVersion) -> None:
        version.retired = True
        if version.loading is not None:
            version.loading.cancel()
        if version.active == 0:
            self._drop(version)

    def _drop(self, version: AdapterVersion) -> None:
        if version.slot is not None:
            self._eviction.on_remove(version.key)
            self._slots[version.slot] = None
            self._stacks.reset_lora(version.slot)
            version.slot = None
        self._unclaimed.discard(version)
        self._discard_weights(version)

    def _device_images_kept(self) -> int:
        """How many current versions hold a device image (only those do: `_loaded` drops a retired version's, and
        retiring an idle version drops its weights)."""
        return sum(v.weights is not None and v.weights.device_packed is not None for v in self._by_name.values())

    @staticmethod
    def _drop_device_image(version: AdapterVersion) -> None:
        """Let go of the GPU copy a device loader left beside `version`'s host image. It is kept only for a fill
        expected soon (a request waits, or a hot swap's predecessor held a slot), and for at most
        `DEVICE_IMAGES_KEPT` versions at once: that fill then copies device to device instead of host to device,
        and GPU memory holds no more than the few images the KV cache left room for
        (`adapter_device_loader.MAX_DEVICE_IMAGES`)."""
        weights = version.weights
        if weights is not None and weights.device_packed is not None:
            version.weights = dataclasses.replace(weights, device_packed=None)

    def _discard_weights(self, version: AdapterVersion) -> None:
        version.wanted = False  # a request still waiting asks again (`ready`)
        weights, version.weights = version.weights, None
        if weights is not None and self._arena is not None:
            # Copies into a slot may still read the image: the arena reuses it once they have run.
            weights.give_back_host_image(self._arena, self._stacks.copy_stream)

"""Stacked per-slot LoRA weights (vLLM's `lora/` contract) and the host images adapters are copied in from.

`LoRAStacks` preallocates, for every layer and targetable projection, `A[slots, max_rank, in]` and
`B[slots, out, max_rank]` (fused stacks store B rank-major, `[slots, max_rank, out]`, and expose it as that
transposed view); `set_lora(slot, adapter)` copies an adapter in (zero-padded to `max_rank`),
`reset_lora(slot)` clears it. A step's `lora_batch.LoRABatch` carries the slot of every token (-1 = base only),
so one forward pass serves base rows and any mix of adapters and ranks.
"""

from __future__ import annotations

import contextlib
import math
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.config import ModelArch

if TYPE_CHECKING:
    from engine.pinned_arena import PinnedArena

# Projections that share an input, applied together: (group -> members, in fused output column order).
PROJECTION_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """One adapter in host memory: A [r, in] and B [out, r] per (layer, module)."""

    rank: int
    scaling: float
    modules: frozenset[str]
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # For fused (CUDA) stacks the adapter is held instead as one buffer in slot layout (`pack_adapter`,
    # `SlotLayout.images`): layer by layer, per group in `packed_groups`, A [members, rank, in] then B
    # [out, rank] (each member's B as the file stores it, one under the other), at the adapter's own rank.
    # The copy into a slot pads to the stack's max rank and turns B rank-major, as the stacks keep it.
    packed: torch.Tensor | None = None
    packed_groups: tuple[str, ...] = ()
    # The same image on the GPU, as the device loader placed it there (`adapter_device_loader`): a slot fill
    # copies from it instead of from `packed`, device to device. The pool keeps it only while a fill is expected
    # soon (`AdapterPool._drop_device_image`), and `nbytes` does not count it: it is not part of the host tier.
    device_packed: torch.Tensor | None = None
    # Passed once `packed` is written, where a copy into it was still in flight when the weights were handed
    # over (the device loader's copy back from the GPU): fills wait for it on the device, and the arena
    # reuses the extent only after it (`give_back_host_image`). None: written already.
    host_ready: torch.cuda.Event | None = None

    def give_back_host_image(self, arena: PinnedArena, stream: torch.cuda.Stream | None = None) -> bool:
        """`packed`'s extent back to `arena` (False if there is none, or the arena did not hand it out), reused
        once a copy into it still in flight (`host_ready`), and with `stream` the work queued on it so far
        (copies out of it), have run."""
        return self.packed is not None and arena.give_back(self.packed, stream, self.host_ready)

    @property
    def nbytes(self) -> int:
        loose = sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.tensors.values())
        return loose + (0 if self.packed is None else self.packed.numel() * self.packed.element_size())


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """Shapes of fused stacks, per projection group: plain data, so a loader process can pack adapters
    without the stacks themselves."""

    num_layers: int
    max_rank: int
    group_slices: dict[str, tuple[int, ...]]  # output width of each member
    group_fan_in: dict[str, int]

    def layer_size(self, groups: Iterable[str], rank: int) -> int:
        """Elements of one layer of an adapter image of `rank` covering `groups`."""
        return sum(math.prod(a[1:]) + math.prod(b[1:]) for a, b in (self._shapes(group, rank) for group in groups))

    def image_size(self, groups: Iterable[str], rank: int) -> int:
        """Elements of an adapter image of `rank` covering `groups`."""
        return self.num_layers * self.layer_size(groups, rank)

    def _shapes(self, group: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A [layers, members, rank, in] and B [layers, out, rank] of `group` in an image of `rank`."""
        slices = self.group_slices[group]
        return (self.num_layers, len(slices), rank, self.group_fan_in[group]), (self.num_layers, sum(slices), rank)

    def layer_span(self, groups: Iterable[str], rank: int, layers: range) -> tuple[int, int]:
        """The element range [start, stop) of an image of `groups` at `rank` that holds `layers` (`images`:
        an image holds its layers one after another)."""
        size = self.layer_size(groups, rank)
        return layers.start * size, layers.stop * size

    def images(
        self, buffer: torch.Tensor, groups: tuple[str, ...], rank: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of `buffer` (flat, at least the image's size) as each group's A [layers, members, rank, in] and
        B [layers, out, rank].

        The image is layer-major: its layers one after another, each holding every group's A then B in turn.
        Any run of layers is then one contiguous range: a layered fill copies a chunk of layers to the device
        with one copy (`LoRAStacks.layered_fills`; group-major, a chunk took a copy per group and matrix), and a
        loader process checks the layers it wrote as one span.

        B is out-major, as PEFT files store it (a member's B is [out, rank]), not rank-major as the stacks keep
        it: packing then converts each B with one contiguous copy on the loader's CPU, and the fill's device copy
        transposes it. Packed rank-major, B's transposed copy took most of a load's packing time (4 of 32
        Llama-7B layers on one core of an H100 host: 3.20 ms packed so, 1.53 ms now; the fill's device time
        is the same; bench/RESULTS-gpu.md, stop 32)."""
        size = self.layer_size(groups, rank)
        by_layer = buffer[: self.num_layers * size].view(self.num_layers, size)
        out, offset = [], 0
        for group in groups:
            a_shape, b_shape = self._shapes(group, rank)
            a_size, b_size = math.prod(a_shape[1:]), math.prod(b_shape[1:])
            a_img = by_layer[:, offset : offset + a_size].unflatten(1, a_shape[1:])
            out.append((a_img, by_layer[:, offset + a_size : offset + a_size + b_size].unflatten(1, b_shape[1:])))
            offset += a_size + b_size
        return out


def image_groups(modules: Iterable[str]) -> tuple[str, ...]:
    """The projection groups an adapter of `modules` stores in its slot image, in image order."""
    touched = set(modules)
    return tuple(g for g, members in PROJECTION_GROUPS.items() if touched.intersection(members))


def pack_adapter(layout: SlotLayout, adapter: AdapterWeights, dtype: torch.dtype, pin: bool) -> AdapterWeights:
    """The adapter (any float dtype) as one new `dtype` host buffer in slot layout at its own rank, pinned if
    `pin`.

    `LoRAStacks.set_lora` then moves it with one host->device copy and a few strided device copies,
    whatever the number of layers; the host tiers hold rank, not max-rank, bytes. Groups the adapter
    leaves alone are not stored (their group rank of 0 makes the kernels skip them)."""
    groups = image_groups(adapter.modules)
    size = layout.image_size(groups, adapter.rank)
    buffer = torch.empty(size, dtype=dtype, pin_memory=pin)
    LayerCopies.of(layout, buffer, groups, adapter.rank, adapter.tensors, range(layout.num_layers)).run()
    return AdapterWeights(adapter.rank, adapter.scaling, adapter.modules, {}, buffer, groups)


def member_places(
    layout: SlotLayout, groups: tuple[str, ...], images: list[tuple[torch.Tensor, torch.Tensor]], layers: range
) -> Iterator[tuple[int, str, torch.Tensor, torch.Tensor]]:
    """Where each projection's A [rank, in] and B [out, rank] of `layers` go in an image (`images`: its groups'
    views, `SlotLayout.images`): (layer, module, A's place, B's place), group by group, layer by layer."""
    for group, (a_img, b_img) in zip(groups, images, strict=True):
        for layer in layers:
            n0 = 0
            for i, (module, width) in enumerate(zip(PROJECTION_GROUPS[group], layout.group_slices[group], strict=True)):
                yield layer, module, a_img[layer, i], b_img[layer, n0 : n0 + width]
                n0 += width


@dataclass(frozen=True, slots=True)
class LayerCopies:
    """The copies that write the `layers` of an adapter image (`tensors`: (layer, module) -> (A, B), any float
    dtype) into their place in `image`, the whole image of `groups` at `rank`; members of a group that
    `tensors` lacks are zeroed. Made once (`of`), run any number of times: the device loader keeps them for files
    laid out alike, as the versions of one adapter are."""

    dst: list[torch.Tensor]
    src: list[torch.Tensor]
    absent: list[torch.Tensor]  # members the adapter lacks: zeroed
    spans: list[torch.Tensor]

    @staticmethod
    def of(
        layout: SlotLayout,
        image: torch.Tensor,
        groups: tuple[str, ...],
        rank: int,
        tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
        layers: range,
    ) -> LayerCopies:
        start, stop = layout.layer_span(groups, rank, layers)
        copies = LayerCopies([], [], [], [image[start:stop]])
        images = layout.images(image, groups, rank)
        for layer, module, a, b in member_places(layout, groups, images, layers):
            pair = tensors.get((layer, module))
            if pair is None:
                copies.absent.extend((a, b))
            else:
                copies.dst.extend((a, b))
                copies.src.extend(pair)
        return copies

    def run(self) -> list[torch.Tensor]:
        """Copy. Returns the part of the image written (`spans`: one contiguous span, the layers' range), so
        that loader processes can fill the layers of one image side by side and each check its own span."""
        if self.absent:
            torch._foreach_zero_(self.absent)
        if self.dst:
            torch._foreach_copy_(self.dst, self.src)
        return self.spans


@dataclass(frozen=True, slots=True)
class ChunkCopies:
    """What a layered fill copies for one chunk of layers (`LoRAStacks._layered_copies`)."""

    span: tuple[int, int]  # the chunk's layers in the host image, copied into the same place of the staging buffer:
    staged: torch.Tensor  # that place
    src: list[torch.Tensor]  # staged A and B views of the chunk's layers
    dst: list[torch.Tensor]  # their places in the slot
    padding: list[torch.Tensor]  # the slot's rows past the adapter's rank, of the chunk's layers
    placement: torch.cuda.CUDAGraph | None  # the copies into the slot as one graph (`_prepare_layered`'s keys)

    def place(self) -> None:
        """Zero the padding and copy the staged layers into the slot, on the current stream."""
        if self.placement is not None:
            self.placement.replay()
            return
        if self.padding:
            torch._foreach_zero_(self.padding)
        if self.dst:
            torch._foreach_copy_(self.dst, self.src)


def fill_chunks(num_layers: int) -> tuple[range, ...]:
    """The layer ranges a layered fill copies one after another (`LoRAStacks.layered_fills`): 1, 2, 4, ...
    layers, the last taking all that remains once less than twice its size would be left after it.

    The first is one layer, so a step's first layer waits for little more than one layer's copy; each later
    one doubles, since a layer computes for longer than its copy takes (a lone prompt of ~25 tokens at Llama-7B
    dims: ~0.13 ms a layer, against ~0.05 ms to copy a rank-16 adapter's layer), so the copies keep ahead of
    the layers that wait for them while a fill stays a few launches."""
    chunks: list[range] = []
    start, size = 0, 1
    while start < num_layers:
        stop = num_layers if num_layers - (start + size) < 2 * size else start + size
        chunks.append(range(start, stop))
        start, size = stop, 2 * size
    return tuple(chunks)


class LoRAStacks:
    """Preallocated stacked adapter weights for `slots` adapters of rank <= `max_rank`."""

    def __init__(
        self,
        arch: ModelArch,
        slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool | None = None,
        fold_shrinks: bool = False,
        lora_gemm: bool = False,
        lora_gemm_few: bool = False,
        layered_fills: bool = False,
    ):
        """`fused` (default: on CUDA) lays each projection group out as one stack (see below). `fold_shrinks`:
        decode-sized CUDA steps fold the q/k/v, gate/up and down shrinks into the norm and SiLU kernels that
        write their inputs (`LoRABatch.norm`, `LoRABatch.silu_and_mul`). `lora_gemm`: decode-sized CUDA steps
        run each projection as one GEMM with its LoRA inside (`LoRABatch.project`) where the rows use one adapter,
        and with `lora_gemm_few` also where they use 2 to `few_capacity` adapters. `layered_fills` (CUDA, fused):
        make the gates layered fills need (`layer_gates`); without them no forward waits for any."""
        self.slots, self.max_rank, self.dtype = slots, max_rank, dtype
        self.fold_shrinks = fold_shrinks
        self.lora_gemm = lora_gemm
        self.lora_gemm_few = lora_gemm_few
        shapes = arch.projection_shapes()
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        self.bt: dict[tuple[int, str], torch.Tensor] = {}
        # On CUDA the projections of a group (sharing an input) live in one fused stack, A along the rank
        # axis and B along the output axis (kernels.py "Fused projections"): one kernel pair per group.
        # Its B is stored rank-major, [slots, max_rank, out], and seen here (group_b, b) as the transposed
        # [slots, out, max_rank] view: the expand kernel then reads only a slot's first `rank` rows, whole.
        self.group_a: dict[tuple[int, str], torch.Tensor] = {}
        self.group_b: dict[tuple[int, str], torch.Tensor] = {}
        self.group_slices = {g: tuple(shapes[m][1] for m in members) for g, members in PROJECTION_GROUPS.items()}
        fused = device.type == "cuda" if fused is None else fused
        # A fused group's stacks of all layers are one tensor each, [layers, slots, ...]: a slot of every
        # layer is then one strided view, which `set_lora` fills with one copy per group.
        self._group_a_all: dict[str, torch.Tensor] = {}
        self._group_b_all: dict[str, torch.Tensor] = {}
        group_fan_in = {g: shapes[members[0]][0] for g, members in PROJECTION_GROUPS.items()}
        if fused:
            for group, members in PROJECTION_GROUPS.items():
                a_shape = (arch.num_layers, slots, len(members) * max_rank, group_fan_in[group])
                b_shape = (arch.num_layers, slots, max_rank, sum(self.group_slices[group]))
                self._group_a_all[group] = torch.zeros(a_shape, dtype=dtype, device=device)
                self._group_b_all[group] = torch.zeros(b_shape, dtype=dtype, device=device)
        for layer in range(arch.num_layers):
            for group, members in PROJECTION_GROUPS.items():
                fan_in = group_fan_in[group]
                if fused:
                    a, b = self._group_a_all[group][layer], self._group_b_all[group][layer].transpose(-1, -2)
                    self.group_a[(layer, group)], self.group_b[(layer, group)] = a, b
                n0 = 0
                for i, module in enumerate(members):
                    fan_out = shapes[module][1]
                    if fused:  # views into the group's stacks
                        self.a[(layer, module)] = a[:, i * max_rank : (i + 1) * max_rank]
                        self.b[(layer, module)] = b[:, n0 : n0 + fan_out]
                    else:
                        self.a[(layer, module)] = torch.zeros(slots, max_rank, fan_in, dtype=dtype, device=device)
                        self.b[(layer, module)] = torch.zeros(slots, fan_out, max_rank, dtype=dtype, device=device)
                        # B^T of every slot side by side, [slots * max_rank, out]: the CPU decode path
                        # multiplies by all slots at once instead of one small matmul per adapter.
                        self.bt[(layer, module)] = torch.zeros(slots * max_rank, fan_out, dtype=dtype, device=device)
                    n0 += fan_out
        # Columns of one step's fp32 shrink output per (layer, group): one zeroed workspace serves a step.
        self.h_offsets: dict[tuple[int, str], tuple[int, int]] = {}
        for key, a in self.group_a.items():
            self.h_offsets[key] = (sum(w for _, w in self.h_offsets.values()), a.shape[1])
        self.h_width = sum(w for _, w in self.h_offsets.values())
        self.layout = SlotLayout(arch.num_layers, max_rank, self.group_slices, group_fan_in) if fused else None
        # Fills stage a host image here (the largest an adapter can have) before copying it into its slot: one
        # copy in, and the views of each (groups, rank) made once. A fresh device buffer and its views per fill
        # cost the engine's thread 0.08 ms of a 0.2 ms fill (H200 host). Fills run in order on one stream, so
        # the next fill's copy in waits for the last one's copies out.
        self._staging: torch.Tensor | None = None
        if self.layout is not None:
            full = self.layout.image_size(PROJECTION_GROUPS, max_rank)
            self._staging = torch.empty(full, dtype=dtype, device=device)
        self._staging_views: dict[tuple[tuple[str, ...], int], list[torch.Tensor]] = {}
        self.modules: frozenset[str] = frozenset(shapes)
        # Per slot: its rank, its rank per group (0 where its adapter touches none of the group's projections:
        # the CUDA kernels skip those, as a captured graph applies every group whatever the batch's adapters)
        # and its scaling, as the rows of one int32 table (the scalings' row holds float32 bits). A slot's
        # column is written by one asynchronous copy (`_write_slot`).
        self._slot_table = torch.zeros(len(PROJECTION_GROUPS) + 2, slots, dtype=torch.int32, device=device)
        self.ranks = self._slot_table[0]
        self.group_ranks = {g: self._slot_table[1 + i] for i, g in enumerate(PROJECTION_GROUPS)}
        self.scalings = self._slot_table[-1].view(torch.float32)
        # Host-side copies so the CPU path never synchronises to read a rank.
        self.slot_ranks = [0] * slots
        self.slot_scalings = [0.0] * slots
        self.slot_modules: list[frozenset[str]] = [frozenset()] * slots
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ready: list[torch.cuda.Event | None] = [None] * slots
        # Per slot: an event after the last step that read it (`mark_read`). A fill or reset of the slot waits
        # for that step alone, not for all the work queued before it: a fill for a request admitted while a step
        # runs then copies beside that step, where it started only once the step had ended, and the next step,
        # which waits for the fill, started that much later (a 38 MiB host image: 0.76 ms on an H100).
        self._last_read: list[torch.cuda.Event | None] = [None] * slots
        self.fill_beside_steps = True  # False: wait for all work queued before (benchmarks compare)
        if self._copy_stream is not None:  # a slot no step has read yet: its first fill after the zeroing above
            self._copy_stream.wait_stream(torch.cuda.current_stream(device))
        self._fill_views: dict[tuple[int, tuple[str, ...], int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        # Layered fills (fused CUDA stacks): a fill from host RAM copies its layers in chunks (`fill_chunks`),
        # each followed by its chunk's gate; every forward waits for a chunk's gate before the chunk's first
        # layer (`layer_gates`, in graphs too), so a step starts while the later layers still copy. An idle
        # engine's first step for an adapter in host RAM waited for the whole copy before its first layer
        # (0.74 ms of a 16-layer Llama-7B image on an H100: its TTFT was 1.12-1.17x warm).
        self.layered_fills = layered_fills  # False (with the gates made): every fill is waited for whole
        self.layered = 0  # fills copied layered
        self._chunks = fill_chunks(arch.num_layers)
        self.layer_gates: dict[int, torch.cuda.Event] = {}
        self._chunk_copies: dict[tuple[int, tuple[str, ...], int], list[ChunkCopies]] = {}
        self._capture_stream: torch.cuda.Stream | None = None  # (`_capture_placement`)
        if self._copy_stream is not None and self.layout is not None and layered_fills:
            self._make_gates()
            if self.layer_gates:
                self._prepare_layered(slots)

    def _make_gates(self) -> None:
        """One gate per chunk of layers, recorded once: a graph captures a wait only on an event that was
        recorded. External events: a captured wait stays a wait on the gate's latest record, not a dependency
        inside the graph. The first chunk's gate is the slot table's too (layer 0 reads it).

        The gates are shared by all slots: a step waits for the chunks of the last layered fill whatever its
        adapters, so a fill is layered only where its copies wait for nothing (`_can_layer`): they then start at
        once, and each chunk's copy takes less time than the layers before it take to compute."""
        if len(self._chunks) < 2:
            return
        for chunk in self._chunks:
            gate = torch.cuda.Event(external=True)
            gate.record(self._copy_stream)
            self.layer_gates[chunk.start] = gate

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        """The side stream that copies adapters into slots (CUDA), reading their host images."""
        return self._copy_stream

    def pack(self, adapter: AdapterWeights) -> AdapterWeights:
        """`pack_adapter` for this engine's stacks (pinned when CUDA is present); loose stacks keep it as is."""
        if self.layout is None:
            return adapter
        return pack_adapter(self.layout, adapter, self.dtype, pin=torch.cuda.is_available())

    def set_lora(self, slot: int, adapter: AdapterWeights) -> None:
        """Copy `adapter` into `slot` (replacing whatever was there).

        On CUDA the copies run on a side stream, after the last step that read the slot (`mark_read`; it may
        still read the slot's previous adapter), beside any other work; the next step that uses the slot waits
        for them (`wait_ready`).
        Fused stacks take packed adapters (`pack`; loose ones are packed first): one host->device copy,
        then one strided copy and one zeroing per projection group. Loose stacks take one multi-tensor
        zeroing and one multi-tensor copy.
        """
        if adapter.rank > self.max_rank:
            raise ValueError(f"rank {adapter.rank} exceeds the engine's max_lora_rank {self.max_rank}")
        if self.layout is not None and adapter.packed is None:
            # Fused stacks are only ever filled whole groups at a time, which is what lets `reset_lora`
            # skip zeroing them.
            adapter = self.pack(adapter)
        r = adapter.rank
        stream = self._copy_stream
        layered = self._can_layer(slot, adapter)
        if stream is not None:
            self._after_last_read(slot, stream)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if layered:
                self._copy_layered(slot, adapter)
            elif adapter.packed is not None:
                self._copy_packed(slot, adapter)
            else:
                self._copy_loose(slot, adapter)
            if not layered:
                self._write_slot(slot, r, adapter.scaling, adapter.modules)
        if layered:  # the steps that read the slot wait for its layers' gates, not for the whole fill
            self._ready[slot] = None
            self.layered += 1
        elif stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self._ready[slot] = event
        self.slot_ranks[slot] = r
        self.slot_scalings[slot] = adapter.scaling
        self.slot_modules[slot] = adapter.modules

    def _can_layer(self, slot: int, adapter: AdapterWeights) -> bool:
        """Whether `adapter`'s fill into `slot` is copied layered: a host image (one already on the device copies
        in microseconds), the gates made, and nothing it could wait behind still to run: its host image
        written, the copy stream idle and the slot's last reader done. A step queued before the fill then never
        waits on gates whose copies wait on that step (a wait inside a graph might take a gate's record made
        after the graph's launch)."""
        stream = self._copy_stream
        if not (self.layered_fills and self.fill_beside_steps and self.layer_gates and stream is not None):
            return False
        if adapter.packed is None or adapter.device_packed is not None:
            return False
        # A host image still being written (a device loader's copy back): every step that uses any adapter
        # would wait for it at its first layer.
        if adapter.host_ready is not None and not adapter.host_ready.query():
            return False
        last = self._last_read[slot]
        return bool(stream.query()) and (last is None or bool(last.query()))

    def _copy_layered(self, slot: int, adapter: AdapterWeights) -> None:
        """Copy a packed host image into `slot` chunk by chunk (`fill_chunks`), each chunk's gate after its
        layers (`_copy_packed` copies it whole); the slot table first, under the first gate."""
        assert adapter.packed is not None and self._staging is not None  # (and its host image written)
        self._write_slot(slot, adapter.rank, adapter.scaling, adapter.modules)
        source = adapter.packed
        copies = self._layered_copies(slot, adapter.packed_groups, adapter.rank)
        for gate, chunk in zip(self.layer_gates.values(), copies, strict=True):  # (made in chunk order)
            chunk.staged.copy_(source[chunk.span[0] : chunk.span[1]], non_blocking=True)
            chunk.place()
            gate.record()

    def _layered_copies(
        self, slot: int, groups: tuple[str, ...], rank: int, capture: bool = False
    ) -> list[ChunkCopies]:
        """Per chunk of layers: the image's element range to copy into staging, and the staged views to copy
        into `slot` and the padding to zero there, of those layers (made once per (slot, groups, rank)).

        With `capture`, each chunk's placement is also captured as a graph (`_capture_placement`): only when the
        stacks are made (`_prepare_layered`). A capture while serving would take the engine thread's time in
        a fill and put the process's allocator and generator in capture mode meanwhile; other keys place
        their chunks with the copies themselves."""
        key = (slot, groups, rank)
        if key not in self._chunk_copies:
            assert self.layout is not None and self._staging is not None
            staging, layout = self._staging, self.layout
            src = self._staged_views(groups, rank)
            dst, padding = self._slot_views(slot, groups, rank)
            copies = []
            for chunk in self._chunks:
                start, stop = layout.layer_span(groups, rank, chunk)
                layers = slice(chunk.start, chunk.stop)
                chunk_src, chunk_dst = [t[layers] for t in src], [t[layers] for t in dst]
                chunk_padding = [t[layers] for t in padding]
                placement = self._capture_placement(chunk_src, chunk_dst) if capture else None
                copies.append(
                    ChunkCopies((start, stop), staging[start:stop], chunk_src, chunk_dst, chunk_padding, placement)
                )
            self._chunk_copies[key] = copies
        return self._chunk_copies[key]

    def _capture_placement(self, src: list[torch.Tensor], dst: list[torch.Tensor]) -> torch.cuda.CUDAGraph:
        """A full-rank chunk's placement (`ChunkCopies.place`: its copies, no padding) captured as a CUDA graph,
        replayed with one launch.

        Launched one by one, a chunk's copies (two per group) take a few microseconds of the engine thread each,
        and it issues a fill before it launches the step after it: a layered fill of 16 Llama-7B layers took
        0.51-0.54 ms to issue against 0.11 ms whole (stop 42; some of that may have been a slot's first fill
        making its views). Captured on a stream of its own, thread-local, with no sync: the engine's other
        threads keep using the GPU meanwhile."""
        assert self._staging is not None
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self._staging.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._capture_stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                torch._foreach_copy_(dst, src)
            finally:
                graph.capture_end()
        return graph

    def _prepare_layered(self, slots: int) -> None:
        """Make every slot's layered copies (`_layered_copies`) for a full-rank adapter of every group, their
        placements captured, so that a slot's first layered fill makes none (a slot's first took up to 1.5 ms
        of the engine thread at Llama-7B dims, stop 42). Other ranks and groups make their views at their first
        fill and place their chunks uncaptured. A capture that fails fails the stacks' making.

        The copies run once first, uncaptured: zeros into slot 0, zeros as made, on the copy stream that orders
        its fills, so that their kernels are loaded before a capture takes them (at full rank there is no
        padding to zero: the graphs hold copies only)."""
        assert self._staging is not None and self._copy_stream is not None
        groups = tuple(PROJECTION_GROUPS)
        with torch.cuda.stream(self._copy_stream):
            self._staging.zero_()
            dst, _ = self._slot_views(0, groups, self.max_rank)  # (no padding at full rank)
            torch._foreach_copy_(dst, self._staged_views(groups, self.max_rank))
        for slot in range(slots):
            self._layered_copies(slot, groups, self.max_rank, capture=True)

    def _write_slot(self, slot: int, rank: int, scaling: float, modules: frozenset[str]) -> None:
        """Write `slot`'s column of the slot table on the current stream, without waiting for it.

        One copy from page-locked memory: writing the device values one by one copied each from pageable
        memory and synchronised its stream after each (12 times per fill and eviction), so the engine's
        thread waited for the work queued before them."""
        on_gpu = self._slot_table.is_cuda
        group_ranks = [rank if modules.intersection(members) else 0 for members in PROJECTION_GROUPS.values()]
        (scaling_bits,) = struct.unpack("<i", struct.pack("<f", scaling))
        column = torch.tensor([rank, *group_ranks, scaling_bits], dtype=torch.int32, pin_memory=on_gpu)
        # A page-locked source stays allocated until the copy has read it (torch's host allocator).
        self._slot_table[:, slot].copy_(column, non_blocking=on_gpu)

    def _copy_packed(self, slot: int, adapter: AdapterWeights) -> None:
        # Per group, the slot of every layer is one strided view: copy the image into its first `rank`
        # rows (A, and B turned rank-major), zero the rest up to max rank. Groups the adapter leaves alone keep
        # stale weights behind a group rank of 0, which the kernels skip.
        assert adapter.packed is not None and self._staging is not None
        source = adapter.packed if adapter.device_packed is None else adapter.device_packed
        if adapter.device_packed is None and adapter.host_ready is not None:
            torch.cuda.current_stream().wait_event(adapter.host_ready)  # the host image is still being written
        self._staging[: source.numel()].copy_(source, non_blocking=True)
        if source.is_cuda:  # its memory is not reused before this copy (on the side stream) has read it
            source.record_stream(torch.cuda.current_stream(source.device))
        r = adapter.rank
        src = self._staged_views(adapter.packed_groups, r)
        dst, padding = self._slot_views(slot, adapter.packed_groups, r)
        if padding:
            torch._foreach_zero_(padding)
        if dst:
            torch._foreach_copy_(dst, src)

    def _staged_views(self, groups: tuple[str, ...], rank: int) -> list[torch.Tensor]:
        """A and B of each of `groups` in the staging buffer, for an image of `rank` (made once)."""
        key = (groups, rank)
        if key not in self._staging_views:
            assert self.layout is not None and self._staging is not None
            images = self.layout.images(self._staging, groups, rank)
            # B [layers, out, rank] read as [layers, rank, out]: the copy into the slot transposes it.
            self._staging_views[key] = [t for a, b in images for t in (a, b.transpose(1, 2))]
        return self._staging_views[key]

    def _slot_views(
        self, slot: int, groups: tuple[str, ...], rank: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Where an image of `groups` at `rank` goes in `slot` (A and B per group, as `SlotLayout.images`
        orders them) and the rows past `rank` to zero. Made once per (slot, groups, rank): each view costs a
        few microseconds of the engine thread's time, in every fill."""
        key = (slot, groups, rank)
        if key not in self._fill_views:
            dst: list[torch.Tensor] = []
            padding: list[torch.Tensor] = []
            for group in groups:
                members = len(PROJECTION_GROUPS[group])
                a = self._group_a_all[group][:, slot].unflatten(1, (members, self.max_rank))  # [L, members, R, in]
                b = self._group_b_all[group][:, slot]  # [L, R, out]
                dst += [a[:, :, :rank], b[:, :rank]]
                if rank < self.max_rank:
                    padding += [a[:, :, rank:], b[:, rank:]]
            self._fill_views[key] = (dst, padding)
        return self._fill_views[key]

    def _copy_loose(self, slot: int, adapter: AdapterWeights) -> None:
        r = adapter.rank
        _zero(self._stale_views(slot, adapter))
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for key, (a, b) in adapter.tensors.items():
            dst += [self.a[key][slot, :r], self.b[key][slot, :, :r]]
            src += [a, b]
            if key in self.bt:
                dst.append(self.bt[key][slot * self.max_rank : slot * self.max_rank + r])
                src.append(b.t())
        if dst:
            torch._foreach_copy_(dst, src, non_blocking=True)

    @property
    def few_capacity(self) -> int:
        """How many adapters a decode step may use and still run its projections as few-adapter LoRA GEMMs
        (`lora_gemm_few`; `kernels_gemm_lora_few.capacity`): 8 at rank 16, 2 at rank 64; 0 with the mode off."""
        if not (self.lora_gemm and self.lora_gemm_few):
            return 0
        from engine import kernels_gemm_lora_few

        return kernels_gemm_lora_few.capacity(self.max_rank)

    def few_list(self, slots: list[int]) -> list[int] | None:
        """The list a step's distinct adapter `slots` give the few-adapter LoRA GEMMs, padded with -1 to
        `few_capacity`; None where they are not 2 to `few_capacity` (the step keeps the other kernels)."""
        capacity = self.few_capacity
        if not 2 <= len(slots) <= capacity:
            return None
        return slots + [-1] * (capacity - len(slots))

    def mark_read(self, slots: Iterable[int]) -> None:
        """Note that the work queued so far on the current stream (a step) reads `slots`: their next fill or
        reset waits for it (CUDA; no-op elsewhere)."""
        if self._copy_stream is None:
            return
        event: torch.cuda.Event | None = None
        for slot in slots:
            if event is None:
                event = torch.cuda.Event()
                event.record()
            self._last_read[slot] = event

    def _after_last_read(self, slot: int, stream: torch.cuda.Stream) -> None:
        if not self.fill_beside_steps:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
            return
        event = self._last_read[slot]
        if event is not None:
            stream.wait_event(event)

    def wait_ready(self, slots: Iterable[int]) -> None:
        """Make the current stream wait for pending copies into `slots` (CUDA; no-op elsewhere)."""
        for slot in slots:
            event = self._ready[slot]
            if event is not None:
                torch.cuda.current_stream(event.device).wait_event(event)
                self._ready[slot] = None

    def _stale_views(self, slot: int, incoming: AdapterWeights | None) -> list[torch.Tensor]:
        """Parts of `slot` the incoming adapter will not overwrite but the current one wrote."""
        old_rank = self.slot_ranks[slot]
        if old_rank == 0:
            return []
        new_rank = 0 if incoming is None else incoming.rank
        new_keys = set() if incoming is None else set(incoming.tensors)
        views: list[torch.Tensor] = []
        for key, a in self.a.items():
            if key[1] not in self.slot_modules[slot]:
                continue
            rows = slice(0, old_rank) if key not in new_keys else slice(new_rank, old_rank)
            if rows.start >= rows.stop:
                continue
            views += [a[slot, rows], self.b[key][slot, :, rows]]
            if key in self.bt:
                base = slot * self.max_rank
                views.append(self.bt[key][base + rows.start : base + rows.stop])
        return views

    def reset_lora(self, slot: int) -> None:
        """Clear `slot`: afterwards it contributes nothing.

        Fused stacks are not zeroed: group ranks of 0 hide the slot from the kernels, and the next fill
        rewrites whole groups, padding included. That saves an eviction hundreds of small device launches
        on the engine's thread (one per strided view)."""
        stream = self._copy_stream
        if stream is not None:  # in order with the slot's fills, after its last reader
            self._after_last_read(slot, stream)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if self.layout is None:
                _zero(self._stale_views(slot, None))
            self._write_slot(slot, 0, 0.0, frozenset())
        self.slot_ranks[slot] = 0
        self.slot_scalings[slot] = 0.0
        self.slot_modules[slot] = frozenset()
        self._ready[slot] = None


def _zero(views: list[torch.Tensor]) -> None:
    if views:  # the multi-tensor op refuses an empty list
        torch._foreach_zero_(views)

"""Layered slot fills (`LoRAStacks.layered_fills`) on the CPU, with the copy stream and CUDA events stood in
for: a fill copies its layers chunk by chunk, each chunk's gate recorded once its layers (and, for the first, the
slot table) are in place; every forward waits for a chunk's gate before the chunk's first layer; and a fill that
could wait behind a step still to run is copied whole."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import pytest
import torch

from engine.kv_cache import KVCache
from engine.lora import AdapterWeights, LayerCopies, LoRAStacks, fill_chunks, image_groups
from engine.lora_batch import LoRABatch
from engine.model import DecoderModel, SeqSlice
from tests.unit.engine.conftest import HostStream
from tests.unit.engine.tiny import TINY

ARCH = dataclasses.replace(TINY, num_layers=8)  # chunks of layers [0, 1), [1, 3), [3, 8)
CPU = torch.device("cpu")


def _adapter(rank: int, modules: tuple[str, ...], seed: int) -> AdapterWeights:
    gen = torch.Generator().manual_seed(seed)
    shapes = ARCH.projection_shapes()
    tensors = {
        (layer, m): (torch.randn(rank, shapes[m][0], generator=gen), torch.randn(shapes[m][1], rank, generator=gen))
        for layer in range(ARCH.num_layers)
        for m in modules
    }
    return AdapterWeights(rank=rank, scaling=0.5, modules=frozenset(modules), tensors=tensors)


class _Event:
    """A CUDA event's stand-in, named in order of making; `done` is what `query` answers."""

    count = 0

    def __init__(self, **kwargs: object) -> None:
        _Event.count += 1
        self.name, self.done = f"event{_Event.count}", True

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def __repr__(self) -> str:
        return self.name


def _slot_state(stacks: LoRAStacks, slot: int) -> list[torch.Tensor]:
    """Everything a fill writes for `slot`, per layer where it has layers: each group's A and B, then its table
    column."""
    groups = [t[:, slot].clone() for all_ in (stacks._group_a_all, stacks._group_b_all) for t in all_.values()]
    return [*groups, stacks._slot_table[:, slot].clone()]


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch, prefill_stream: HostStream, replays: list[object]) -> Iterator[list[object]]:
    """The stream log (`prefill_stream`'s stand-ins), with `torch.cuda.Event` stood in for too."""
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    yield replays


def _stacks(log: list[object], layered: bool) -> LoRAStacks:
    """Fused stacks (the CUDA layout) with a copy stream and gates stood in for."""
    stacks = LoRAStacks(ARCH, slots=2, max_rank=8, dtype=torch.float32, device=CPU, fused=True)
    stacks._copy_stream = HostStream("copy", log)  # type: ignore[assignment]
    stacks._make_gates()
    stacks.layered_fills = layered
    return stacks


def test_chunks_start_with_one_layer_double_and_cover_every_layer_once() -> None:
    assert fill_chunks(8) == (range(0, 1), range(1, 3), range(3, 8))
    assert fill_chunks(16) == (range(0, 1), range(1, 3), range(3, 7), range(7, 16))
    assert fill_chunks(32) == (range(0, 1), range(1, 3), range(3, 7), range(7, 15), range(15, 32))
    for layers in range(1, 70):
        chunks = fill_chunks(layers)
        assert [i for c in chunks for i in c] == list(range(layers))
        assert all(len(b) >= 2 * len(a) for a, b in itertools.pairwise(chunks))


@pytest.mark.parametrize("modules", [("q_proj", "v_proj", "gate_proj", "down_proj"), ("k_proj", "o_proj")])
def test_an_images_layers_lie_one_after_another_so_a_chunk_is_one_copy(modules: tuple[str, ...]) -> None:
    """A slot image is layer-major: the span `layer_span` gives for any run of layers is exactly what the
    images' views of those layers cover, and `LayerCopies` (a loader's part) writes and returns that one span."""
    stacks = LoRAStacks(ARCH, slots=2, max_rank=8, dtype=torch.float32, device=CPU, fused=True)
    layout, adapter = stacks.layout, _adapter(4, modules, 3)
    assert layout is not None
    groups = image_groups(adapter.modules)
    size = layout.image_size(groups, 4)
    for layers in [*fill_chunks(ARCH.num_layers), range(2, 6)]:
        image = torch.zeros(size)
        for a_img, b_img in layout.images(image, groups, 4):
            a_img[layers.start : layers.stop] = 1
            b_img[layers.start : layers.stop] = 1
        start, stop = layout.layer_span(groups, 4, layers)
        assert bool((image[start:stop] == 1).all()) and int(image.count_nonzero()) == stop - start
        written = torch.zeros(size)
        (span,) = LayerCopies.of(layout, written, groups, 4, adapter.tensors, layers).run()
        assert span.data_ptr() == written[start:].data_ptr() and span.numel() == stop - start
        assert int(written[:start].count_nonzero()) == int(written[stop:].count_nonzero()) == 0


def test_a_layered_fill_writes_what_a_whole_fill_does_and_each_gate_follows_its_layers(log: list[object]) -> None:
    """Two fills into one slot (the second at a lower rank, so its padding is zeroed): the slot ends as a whole
    fill leaves it, and when each chunk's gate is recorded its layers, and all before them, are already final."""
    layered, whole = _stacks(log, layered=True), _stacks(log, layered=False)
    snapshots: list[list[torch.Tensor]] = []
    for gate in layered.layer_gates.values():  # snapshot the slot as each gate is recorded
        gate.record = lambda stream=None: snapshots.append(_slot_state(layered, 1))  # type: ignore[method-assign]
    first, second = _adapter(8, ("q_proj", "v_proj", "gate_proj", "down_proj"), 1), _adapter(4, ("k_proj", "o_proj"), 2)
    for adapter in (first, second):
        packed = layered.pack(adapter)
        whole.set_lora(1, packed)
        want = _slot_state(whole, 1)
        del snapshots[:]
        layered.set_lora(1, packed)
        assert layered._ready[1] is None and whole._ready[1] is not None
        for got, expected in zip(_slot_state(layered, 1), want, strict=True):
            torch.testing.assert_close(got, expected)
        assert len(snapshots) == len(layered._chunks) == 3
        for chunk, snapshot in zip(layered._chunks, snapshots, strict=True):
            *groups, table = snapshot
            torch.testing.assert_close(table, want[-1])  # the slot table under the first gate
            for got, expected in zip(groups, want, strict=False):
                torch.testing.assert_close(got[: chunk.stop], expected[: chunk.stop])
    assert layered.layered == 2 and whole.layered == 0


def test_every_forward_waits_for_a_chunks_gate_before_its_first_layer(log: list[object]) -> None:
    stacks = _stacks(log, layered=True)
    stacks.set_lora(0, _adapter(8, ("q_proj", "down_proj"), 3))
    torch.manual_seed(0)
    model = DecoderModel(ARCH).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda module, args, i=i: log.append(f"layer {i}"))
    kv = KVCache(ARCH, slots=2, max_len=32, dtype=torch.float32, device=CPU)
    lora = LoRABatch.build(stacks, [0, 0, 0], CPU)
    del log[:]
    model(torch.tensor([1, 2, 3]), torch.arange(3), [SeqSlice(0, 0, 3, 3)], kv, lora)
    names = {str(gate): chunk.start for gate, chunk in zip(stacks.layer_gates.values(), stacks._chunks, strict=True)}
    order = [e for e in log if isinstance(e, str) and (e.startswith("layer") or e.startswith("main waits event"))]
    expected: list[str] = []
    for i in range(ARCH.num_layers):
        expected += [f"main waits {name}" for name, start in names.items() if start == i] + [f"layer {i}"]
    assert order == expected


@pytest.mark.parametrize(
    "blocker", ["last reader running", "copy stream busy", "host image being written", "layering off", "device image"]
)
def test_a_fill_that_could_wait_behind_other_work_is_copied_whole(log: list[object], blocker: str) -> None:
    """A step queued before the fill might wait on its gates inside a graph, and every step that uses any
    adapter waits on them: the fill must wait for no step (its slot's last reader done, nothing queued on the
    copy stream before it) and for no loader (its host image written)."""
    stacks = _stacks(log, layered=True)
    adapter = stacks.pack(_adapter(8, ("q_proj",), 4))
    if blocker == "last reader running":
        stacks.mark_read([1])
        stacks._last_read[1].done = False  # type: ignore[union-attr]
    elif blocker == "copy stream busy":
        stacks._copy_stream.busy = True  # type: ignore[union-attr]
    elif blocker == "host image being written":
        writing = _Event()
        writing.done = False
        adapter = dataclasses.replace(adapter, host_ready=writing)  # type: ignore[arg-type]
    elif blocker == "layering off":
        stacks.layered_fills = False
    else:
        assert adapter.packed is not None
        adapter = dataclasses.replace(adapter, device_packed=adapter.packed.clone())
    stacks.set_lora(1, adapter)
    assert stacks.layered == 0 and stacks._ready[1] is not None

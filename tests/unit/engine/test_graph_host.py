"""The host side of the captured graphs (`engine.cuda_graphs`) on the CPU: which bucket and graph a step replays,
what its padding rows hold, and the LoRA plan sized for it. A "graph" here reruns its captured forward from the
static buffers at every replay, which is what a CUDA graph replays (tests/gpu run the real ones)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from engine import cuda_graphs
from engine.kv_cache import KVCache
from engine.lora import LoRAStacks
from engine.lora_batch import LoRABatch
from engine.lora_plan import chunk_capacity, plan_segments
from engine.model import DecoderModel, SeqSlice
from tests.unit.engine.test_lora import random_adapter
from tests.unit.engine.tiny import TINY

CPU = torch.device("cpu")
ARCH = dataclasses.replace(TINY, max_position=320)  # room for a KV-length bucket past 256


def _model() -> DecoderModel:
    torch.manual_seed(0)
    model = DecoderModel(ARCH)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return model.eval()


def _stacks(fused: bool) -> LoRAStacks:
    stacks = LoRAStacks(ARCH, slots=3, max_rank=8, dtype=torch.float32, device=CPU, fused=fused)
    stacks.set_lora(0, random_adapter(4, 1.0, ("q_proj", "v_proj", "down_proj"), seed=1))
    stacks.set_lora(1, random_adapter(8, 0.5, ("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj"), seed=2))
    return stacks


def test_chunk_capacity_holds_every_batch_and_plans_group_each_slot() -> None:
    for tokens, slots, block_m in itertools.product(range(7), range(1, 4), (1, 2, 3, 16)):
        capacity = chunk_capacity(tokens, slots, block_m)
        for assign in itertools.product(range(-1, slots), repeat=tokens):
            plan = plan_segments(list(assign), CPU, block_m=block_m, num_chunks=max(capacity, 1))
            order, real = plan.token_order.tolist(), int(plan.num_real[0])
            covered = []
            for slot, start, length, first in plan.chunks.tolist()[:real]:
                rows = order[start : start + length]
                assert 1 <= length <= block_m and first == rows[0] and {assign[t] for t in rows} == {slot}
                covered += rows
            assert sorted(covered) == [t for t, s in enumerate(assign) if s >= 0]
            assert plan.chunks[real:].count_nonzero() == 0


def test_decode_padding_rows_use_the_scratch_slot_and_no_adapter(replays: list[object]) -> None:
    kv = KVCache(ARCH, slots=6, max_len=300, dtype=torch.float32, device=CPU)
    graphs = cuda_graphs.DecodeGraphs(_model(), kv, _stacks(fused=True), 6, None)
    graphs.capture_all()
    assert graphs.batches == [1, 2, 4, 6] and graphs.kv_lens == [256, 300]
    kv.k[0].zero_()
    logits = graphs.run([3, 4, 5], [10, 255, 7], [0, 1, 2], [1, -1, 1])
    assert logits is not None and logits.shape[0] == 3
    assert replays[-1] == cuda_graphs.GraphKey(4, 256, True, False)  # 3 rows in the 4 bucket; key 255 < 256
    assert graphs._inputs[:, :4].tolist() == [[3, 4, 5, 0], [10, 255, 7, 0], [0, 1, 2, kv.scratch_slot]]
    assert graphs._token_slots[:4].tolist() == [1, -1, 1, -1]
    plan = graphs._plans[4]
    assert int(plan.num_real[0]) == 2 and plan.chunks[:2, 0].tolist() == [1, 1]  # the two adapter rows only
    written = kv.k[0].abs().sum(dim=(1, 3)).nonzero().tolist()  # (slot, position) pairs the step wrote
    assert written == [[0, 10], [1, 255], [2, 7], [kv.scratch_slot, 0]]


def test_decode_kv_bucket_holds_the_last_position(replays: list[object]) -> None:
    kv = KVCache(ARCH, slots=2, max_len=300, dtype=torch.float32, device=CPU)
    graphs = cuda_graphs.DecodeGraphs(_model(), kv, _stacks(fused=True), 2, None)
    graphs.capture_all()
    for position, bucket in ((0, 256), (255, 256), (256, 300), (299, 300)):
        assert graphs.run([1, 2], [position, 0], [0, 1], [-1, -1]) is not None
        assert replays[-1] == cuda_graphs.GraphKey(2, bucket, False, False)
    assert graphs.run([1, 2], [300, 0], [0, 1], [-1, -1]) is None  # past the cache: no graph holds it
    assert graphs.run([1, 2, 3], [1, 1, 1], [0, 1, 0], [-1, -1, -1]) is None  # more rows than the largest bucket


@pytest.mark.parametrize("few", [False, True], ids=["single", "few"])
def test_one_adapter_graphs_only_for_batches_of_one_adapter(monkeypatch: pytest.MonkeyPatch, few: bool) -> None:
    """And with `lora_gemm_few`, the few-adapter graphs for batches of 2 to `few_capacity` adapters, their
    adapters listed in the graphs' buffer before the replay."""
    keys: list[cuda_graphs.GraphKey] = []

    class Recorded:
        def __init__(self, key: cuda_graphs.GraphKey) -> None:
            self.key = key

        def replay(self) -> None:
            keys.append(self.key)

    def capture(self: cuda_graphs.DecodeGraphs, key: cuda_graphs.GraphKey) -> None:  # no forward: no triton
        self._graphs[key], self._logits[key] = Recorded(key), torch.zeros(key.batch, 1)  # type: ignore[assignment]

    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: None)
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "_capture", capture)
    stacks = _stacks(fused=True)
    stacks.lora_gemm, stacks.lora_gemm_few = True, few
    kv = KVCache(ARCH, slots=4, max_len=64, dtype=torch.float32, device=CPU)
    graphs = cuda_graphs.DecodeGraphs(_model(), kv, stacks, 4, None)
    graphs.capture_all()
    assert any(key.few for key in graphs.keys) == few
    assert not any(key.few and key.batch == 1 for key in graphs.keys)
    for token_slots, lora, single in (
        ([1, -1, 1], True, True),  # base rows beside one adapter
        ([0, 1, 1], True, False),
        ([-1, -1, -1], False, False),
        ([2, 2, 2], True, True),
        ([2, 0, -1], True, False),
    ):
        graphs.run([1, 2, 3], [5, 6, 7], [0, 1, 2], token_slots)
        several = lora and not single
        assert keys[-1] == cuda_graphs.GraphKey(4, 64, lora, single, few and several)
        if few and several:
            listed = sorted({s for s in token_slots if s >= 0})
            assert graphs._listed.tolist() == listed + [-1] * (stacks.few_capacity - len(listed))


def test_graph_replays_match_eager_steps_across_buckets(replays: list[object]) -> None:
    """Prompts through the prefill graphs (or eagerly past them), then decode steps through the decode graphs,
    across the 256 KV-length bucket and a batch that shrinks: the eager model's logits, step by step."""
    model, fused, loose = _model(), _stacks(fused=True), _stacks(fused=False)
    graphed_kv = KVCache(ARCH, slots=5, max_len=300, dtype=torch.float32, device=CPU)
    eager_kv = KVCache(ARCH, slots=5, max_len=300, dtype=torch.float32, device=CPU)
    decode = cuda_graphs.DecodeGraphs(model, graphed_kv, fused, 5, None)
    prefill = cuda_graphs.PrefillGraphs(model, graphed_kv, fused, None)
    decode.capture_all()
    prefill.capture_all()
    # Every decode graph writes its logits into one buffer (none keeps an output of its own allocated).
    assert {t.data_ptr() for t in decode._logits.values()} == {decode._out.data_ptr()}
    assert prefill.lengths == [16, 32, 64, 128, 256]
    rng = random.Random(0)
    seqs: list[list[int]] = []  # kv slot, LoRA slot, position, next input id
    for length, lora_slot in ((5, 0), (16, -1), (17, 1), (250, 1), (270, -1)):
        prompt = [rng.randrange(ARCH.vocab_size) for _ in range(length)]
        slot = graphed_kv.allocate()
        assert slot is not None and eager_kv.allocate() == slot
        whole = [SeqSlice(slot, 0, length, length)]
        want = model(
            torch.tensor(prompt),
            torch.arange(length),
            whole,
            eager_kv,
            LoRABatch.build(loose, [lora_slot] * length, CPU),
        )
        got = prefill.run(prompt, slot, lora_slot)
        if got is None:  # past the largest bucket: eagerly, as the engine does
            assert length > 256
            lora = LoRABatch.build(fused, [lora_slot] * length, CPU)
            got = model(torch.tensor(prompt), torch.arange(length), whole, graphed_kv, lora)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        seqs.append([slot, lora_slot, length, int(want.argmax())])
    assert prefill.replays == 4
    running, late = seqs[:4], seqs[4]
    for step in range(12):
        if step == 6:  # past position 255 from here on; one sequence ends, the long prompt joins
            running = [running[0], *running[2:], late]
        if step == 9:
            running = running[2:]  # the two past position 255
        slots, lora_slots, positions, ids = (list(column) for column in zip(*running, strict=True))
        got = decode.run(ids, positions, slots, lora_slots)
        assert got is not None
        rows = [SeqSlice(s, i, 1, p + 1) for i, (s, p) in enumerate(zip(slots, positions, strict=True))]
        lora = LoRABatch.build(loose, lora_slots, CPU)
        want = model(torch.tensor(ids), torch.tensor(positions), rows, eager_kv, lora)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for seq, token in zip(running, want.argmax(-1).tolist(), strict=True):
            seq[2], seq[3] = seq[2] + 1, token
    steps = [(key.batch, key.kv_len) for key in replays if isinstance(key, cuda_graphs.GraphKey)]
    assert steps == [(4, 256)] * 6 + [(4, 300)] * 3 + [(2, 300)] * 3
    assert decode.replays == 12


def test_a_prompt_just_under_the_context_replays_the_bucket_of_the_context_length(replays: list[object]) -> None:
    # Buckets stopped below the context length: with a 256-token context, prompts of 129-255 tokens ran eagerly.
    model, stacks = _model(), _stacks(fused=True)
    graphed_kv = KVCache(ARCH, slots=2, max_len=256, dtype=torch.float32, device=CPU)
    eager_kv = KVCache(ARCH, slots=2, max_len=256, dtype=torch.float32, device=CPU)
    prefill = cuda_graphs.PrefillGraphs(model, graphed_kv, stacks, None)
    prefill.capture_all()
    assert prefill.lengths == [16, 32, 64, 128, 256]
    prompt = [random.Random(1).randrange(ARCH.vocab_size) for _ in range(255)]
    got = prefill.run(prompt, 0, 1)
    assert got is not None and replays[-1] == (256, True)
    whole = [SeqSlice(0, 0, 255, 255)]
    lora = LoRABatch.build(_stacks(fused=False), [1] * 255, CPU)
    want = model(torch.tensor(prompt), torch.arange(255), whole, eager_kv, lora)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(graphed_kv.k[0][0, :, :255], eager_kv.k[0][0, :, :255])  # the prompt's keys

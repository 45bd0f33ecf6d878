"""A step's forward pass (`engine.step_forward`) on the CPU, with the decode graphs stood in for (`replays`):
which rows run graphed and which eagerly, the order their logits come in, inputs read from a step still in
flight, prompts prefilled in chunks, and the logits against the eager model's."""

from __future__ import annotations

import dataclasses
from typing import cast

import pytest
import torch

from engine import cuda_graphs
from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.lora_batch import LoRABatch
from engine.model import SeqSlice
from engine.sampling import SamplingParams
from engine.sequence import SeqStatus, Sequence
from engine.step_forward import InFlight, StepForward, TokenReadback
from engine.tokenizer import IncrementalDecoder
from tests.unit.engine.conftest import HostStream
from tests.unit.engine.test_graph_host import ARCH, CPU, _model, _stacks


def _seq(name: str, prompt: list[int], kv_slot: int, lora_slot: int) -> Sequence:
    seq = Sequence(
        name, prompt, SamplingParams(max_tokens=8), None, lambda _: None, cast(IncrementalDecoder, None), None
    )
    seq.kv_slot, seq.lora_slot = kv_slot, lora_slot
    seq.prefilled = len(prompt)  # as `Scheduler.schedule` leaves a prompt it prefills whole
    return seq


def _caches() -> tuple[KVCache, KVCache]:
    return tuple(KVCache(ARCH, slots=4, max_len=300, dtype=torch.float32, device=CPU) for _ in range(2))  # type: ignore[return-value]


def _eager(kv: KVCache, rows: list[tuple[Sequence, list[int], int]]) -> torch.Tensor:
    """The eager model's logits for (sequence, input ids, first position) rows, one forward."""
    ids: list[int] = []
    positions: list[int] = []
    slices: list[SeqSlice] = []
    slots: list[int] = []
    for seq, tokens, first in rows:
        slices.append(SeqSlice(seq.kv_slot, len(ids), len(tokens), first + len(tokens)))
        ids += tokens
        positions += range(first, first + len(tokens))
        slots += [seq.lora_slot] * len(tokens)
    lora = LoRABatch.build(_stacks(fused=False), slots, CPU)
    return _model()(torch.tensor(ids), torch.tensor(positions), slices, kv, lora)


def _graphed(kv: KVCache, fold_prompt_tokens: int = 0, graph_prompt_rows: int = 0) -> StepForward:
    """A forward with decode graphs over `kv`'s rows plus rows for prompt tokens, sized as the engine sizes them
    from these two options (the engine's default gives 32 prompt rows; these tests' prompts need few), and no
    prefill graphs."""
    stacks = _stacks(fused=True)
    config = EngineConfig(fold_prompt_tokens=fold_prompt_tokens, graph_prompt_rows=graph_prompt_rows)
    graphs = cuda_graphs.DecodeGraphs(_model(), kv, stacks, cuda_graphs.decode_graph_rows(kv.total, config), None)
    graphs.capture_all()
    return StepForward(_model(), kv, stacks, CPU, graphs, fold_prompt_tokens=fold_prompt_tokens)


def test_decoding_rows_replay_a_graph_and_new_prompts_follow_eagerly(replays: list[object]) -> None:
    graphed_kv, eager_kv = _caches()
    forward = _graphed(graphed_kv)
    a, b, c = _seq("a", [5, 6, 7, 8, 9], 0, 0), _seq("b", [1, 2, 3], 1, -1), _seq("c", [4, 4, 2, 7], 2, 1)
    for seq in (a, b):  # both already prefilled, one token sampled
        for kv in (graphed_kv, eager_kv):
            _eager(kv, [(seq, seq.prompt_ids, 0)])
        seq.output_ids, seq.status = [11 + seq.kv_slot], SeqStatus.RUNNING

    order, logits = forward.logits([a, c, b], {c: len(c.prompt_ids)}, None)

    assert order == [a, b, c]  # the graph's rows first, then the prompt prefilled eagerly
    assert replays[-1] == cuda_graphs.GraphKey(2, 256, True, False)
    want = _eager(eager_kv, [(a, [11], 5), (b, [12], 3), (c, c.prompt_ids, 0)])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)

    # Next step with its tokens still in flight: inputs come from the device tensor, one position further.
    flight = InFlight.launch(order, torch.tensor([21, 22, 23]), forward.readback)
    order, logits = forward.logits([a, b, c], {}, flight)
    assert order == [a, b, c] and replays[-1] == cuda_graphs.GraphKey(4, 256, True, False)
    want = _eager(eager_kv, [(a, [21], 6), (b, [22], 4), (c, [23], 4)])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_without_graphs_every_row_runs_eagerly_in_the_running_order(replays: list[object]) -> None:
    graphed_kv, eager_kv = _caches()
    forward = StepForward(_model(), graphed_kv, _stacks(fused=True), CPU)
    a, b = _seq("a", [5, 6, 7], 0, 1), _seq("b", [3, 1, 4, 1, 5], 1, 0)
    for kv in (graphed_kv, eager_kv):
        _eager(kv, [(a, a.prompt_ids, 0)])
    a.output_ids, a.status = [9], SeqStatus.RUNNING
    # a's token is in flight; b was not running then
    flight = InFlight.launch([b, a], torch.tensor([0, 30]), forward.readback)

    order, logits = forward.logits([b, a], {b: len(b.prompt_ids)}, flight)

    assert order == [b, a] and replays == []
    want = _eager(eager_kv, [(b, b.prompt_ids, 0), (a, [30], 4)])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_a_prompt_prefilled_in_chunks_beside_graphed_decoding_rows_ends_as_a_whole_prefill(
    replays: list[object],
) -> None:
    """Chunks after the first attend to the keys of the chunks before them (SDPA's own causal mask is aligned to
    the first key, so it would keep a chunk's rows from most of them), eagerly or as rows of the decode graph;
    a chunk short of the prompt's end gets no row, and the last gives the logits a whole prefill gives."""
    graphed_kv, eager_kv = _caches()
    forward = _graphed(graphed_kv)
    a, b = _seq("a", [5, 6, 7], 0, 0), _seq("b", [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 1, 1)
    _eager(graphed_kv, [(a, a.prompt_ids, 0)])
    a.output_ids, a.status = [9], SeqStatus.RUNNING
    b.status, b.prefilled = SeqStatus.RUNNING, 0
    tokens = 9
    # The first chunk starts at position 0 and the second does not fit the decode graph beside a (3 rows free):
    # eager, a alone graphed. The others continue the prompt in rows of the graph beside a's: one short of the
    # prompt's end (its row dropped), then the last (batches of 2 and 3 rows, in buckets 2 and 4).
    for chunk, batch in ((4, 1), (4, 1), (1, 2), (2, 4)):
        b.prefilled += chunk  # as `Scheduler.schedule` does
        order, logits = forward.logits([a, b], {b: chunk}, None)
        assert replays[-1] == cuda_graphs.GraphKey(batch, 256, True, False)
        if not b.prefill_done:
            assert order == [a] and logits.shape[0] == 1
        a.output_ids.append(tokens)
        tokens += 1
    assert forward.folded_rows == 3

    assert order == [a, b]
    whole = _eager(eager_kv, [(b, b.prompt_ids, 0)])
    torch.testing.assert_close(logits[1:], whole, rtol=1e-4, atol=1e-4)
    # The cache holds the prompt's keys as a whole prefill writes them: b's next decode step agrees too.
    b.output_ids = [7]
    order, logits = forward.logits([b], {}, None)
    torch.testing.assert_close(logits, _eager(eager_kv, [(b, [7], len(b.prompt_ids))]), rtol=1e-4, atol=1e-4)


def test_a_prompt_rest_longer_than_the_free_kv_rows_runs_in_the_graphs_prompt_rows(replays: list[object]) -> None:
    """`graph_prompt_rows`: a chunk past a prompt's start (a prefix-cache hit's rest) that the KV rows beside the
    decoding ones could not hold still runs in the decode graph, not eagerly."""
    graphed_kv, eager_kv = _caches()
    forward = _graphed(graphed_kv, graph_prompt_rows=8)  # 4 KV rows + 8: batch buckets 1, 2, 4, 8, 12
    a, b = _seq("a", [5, 6, 7], 0, 0), _seq("b", [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 1, 1)
    _eager(graphed_kv, [(a, a.prompt_ids, 0)])
    a.output_ids, a.status = [9], SeqStatus.RUNNING
    b.status, b.prefilled = SeqStatus.RUNNING, 4
    forward.logits([a, b], {b: 4}, None)  # the prompt's start: eagerly (no prefill graphs here)
    assert replays[-1] == cuda_graphs.GraphKey(1, 256, True, False) and forward.folded_rows == 0
    a.output_ids.append(10)

    b.prefilled = len(b.prompt_ids)
    order, logits = forward.logits([a, b], {b: 7}, None)  # a's row and the rest's seven: 8 rows, past the 4 KV rows

    assert order == [a, b] and replays[-1] == cuda_graphs.GraphKey(8, 256, True, False)
    assert forward.folded_rows == 7
    torch.testing.assert_close(logits[1:], _eager(eager_kv, [(b, b.prompt_ids, 0)]), rtol=1e-4, atol=1e-4)


def test_a_chunk_of_a_prompt_asking_for_prompt_logprobs_stays_out_of_the_decode_graph(replays: list[object]) -> None:
    # The decode graph keeps a folded chunk's last row only: every position's logits would be lost.
    graphed_kv, _ = _caches()
    forward = _graphed(graphed_kv)
    a, b = _seq("a", [5, 6, 7], 0, 0), _seq("b", [3, 1, 4, 1, 5], 1, 1)
    b.params = dataclasses.replace(b.params, prompt_logprobs=2)
    _eager(graphed_kv, [(a, a.prompt_ids, 0)])
    a.output_ids, a.status = [9], SeqStatus.RUNNING
    b.status, b.prefilled = SeqStatus.RUNNING, 2  # its first chunk ran
    b.prefilled += 3
    order, _ = forward.logits([a, b], {b: 3}, None)
    assert order == [a, b] and forward.folded_rows == 0
    assert replays[-1] == cuda_graphs.GraphKey(1, 256, True, False)  # a alone in the graph
    assert [part.targets for part in forward.prompt_rows] == [[1, 5]]  # its positions 2-3 predict these, eagerly


def test_short_prompts_joining_decoding_rows_run_as_rows_of_the_decode_graph(replays: list[object]) -> None:
    """With `fold_prompt_tokens`, a whole prompt that short joins the decode graph's rows while others decode
    (one graph for the step), and gives the eager model's logits; a longer one, or one with no row decoding
    beside it, does not."""
    graphed_kv, eager_kv = _caches()
    forward = _graphed(graphed_kv, fold_prompt_tokens=4)
    a, c, d = _seq("a", [5, 6, 7], 0, 0), _seq("c", [4, 4, 2, 7], 1, 1), _seq("d", [3, 1, 4, 1, 5], 2, -1)

    order, logits = forward.logits([a], {a: 3}, None)  # nothing decodes beside it: eager (no prefill graphs)
    assert order == [a] and replays == [] and forward.folded_rows == 0
    _eager(eager_kv, [(a, a.prompt_ids, 0)])
    a.output_ids, a.status = [9], SeqStatus.RUNNING

    order, logits = forward.logits([a, c, d], {c: 4, d: 5}, None)

    assert order == [a, c, d]  # a's row and c's four in the graph (bucket 8), then d's five eagerly
    assert replays[-1] == cuda_graphs.GraphKey(8, 256, True, False)
    assert (forward.folded_rows, forward.folded_prompts) == (4, 1)
    want = _eager(eager_kv, [(a, [9], 3), (c, c.prompt_ids, 0), (d, d.prompt_ids, 0)])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    # The KV rows hold c's prompt as a whole prefill writes it: its next decode step agrees.
    c.output_ids, c.status = [8], SeqStatus.RUNNING
    order, logits = forward.logits([c], {}, None)
    torch.testing.assert_close(logits, _eager(eager_kv, [(c, [8], 4)]), rtol=1e-4, atol=1e-4)


def test_short_prompts_arriving_together_run_as_rows_of_decode_graphs_of_their_own(replays: list[object]) -> None:
    """Two or more short prompts that no decode row took run together as the rows of decode graphs, as many
    prompts as each graph's rows hold, instead of one prefill (or eager pass) each; one left over alone goes
    the way of a lone prompt. Their logits and KV rows are the eager model's. With a row decoding, the prompts
    that fit join its graph first."""
    graphed_kv, eager_kv = _caches()
    forward = _graphed(graphed_kv, fold_prompt_tokens=5)  # graphs of up to 9 rows
    forward.one_pass_for_groups = False  # (their 12 rows would run in one eager pass: the test below)
    a, c, d = _seq("a", [5, 6, 7], 0, 0), _seq("c", [4, 4, 2, 7], 1, 1), _seq("d", [3, 1, 4, 1, 5], 2, -1)

    order, logits = forward.logits([a, c, d], {a: 3, c: 4, d: 5}, None)  # nothing decodes beside them

    assert order == [a, c, d] and forward.eager_runs == 1  # (this forward has no prefill graphs for d)
    assert forward.eager_started is not None  # (d's eager pass: the engine's pacer times the step up to it)
    assert replays == [cuda_graphs.GraphKey(8, 256, True, False)]
    assert forward.grouped_prompts == 2 and forward.folded_rows == 0  # a and c (7 rows); d's 5 no longer fit
    want = _eager(eager_kv, [(a, a.prompt_ids, 0), (c, c.prompt_ids, 0), (d, d.prompt_ids, 0)])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)

    c.output_ids, c.status = [8], SeqStatus.RUNNING  # c decodes on; a and d ended, their KV rows free
    e, f, g = _seq("e", [2, 7, 1, 8, 2], 0, 1), _seq("f", [6, 1, 8, 2], 2, -1), _seq("g", [9, 3, 3, 1], 3, 0)
    replayed = len(replays)
    order, logits = forward.logits([c, e, f, g], {e: 5, f: 4, g: 4}, None)

    # e joins c's graph (6 of its 9 rows); f and g no longer fit there, and run together in a graph of their own
    assert order == [c, e, f, g] and len(replays) == replayed + 2 and forward.eager_runs == 1
    assert (forward.folded_rows, forward.grouped_prompts) == (5, 4)
    want = _eager(eager_kv, [(c, [8], 4), (e, e.prompt_ids, 0), (f, f.prompt_ids, 0), (g, g.prompt_ids, 0)])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    # The KV rows hold the grouped prompts as whole prefills write them: their next decode step agrees.
    for seq, token in ((f, 5), (g, 6)):
        seq.output_ids, seq.status = [token], SeqStatus.RUNNING
    order, logits = forward.logits([f, g], {}, None)
    torch.testing.assert_close(logits, _eager(eager_kv, [(f, [5], 4), (g, [6], 4)]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("one_pass", [True, False])
def test_prompt_groups_of_more_rows_than_a_graph_holds_run_in_one_eager_pass(
    one_pass: bool, replays: list[object]
) -> None:
    """Four short prompts that fill two graphs' rows: one eager pass over all of their rows (one model read),
    or a graph replay per group, with the eager model's logits and KV rows either way."""
    graphed_kv, eager_kv = _caches()
    forward = _graphed(graphed_kv, fold_prompt_tokens=5)  # graphs of up to 9 rows
    forward.one_pass_for_groups = one_pass
    prompts = ([5, 6, 7], [4, 4, 2, 7], [3, 1, 4], [9, 2, 6, 5])
    seqs = [_seq(f"p{i}", prompt, i, (-1, 0, 1, 0)[i]) for i, prompt in enumerate(prompts)]

    order, logits = forward.logits(seqs, {s: len(s.prompt_ids) for s in seqs}, None)

    assert order == seqs and forward.grouped_prompts == 4 and forward.eager_runs == 0
    assert (forward.group_passes, len(replays)) == ((1, 0) if one_pass else (0, 2))
    assert (forward.eager_started is not None) is one_pass  # (the engine's pacer times the step up to it)
    want = _eager(eager_kv, [(s, s.prompt_ids, 0) for s in seqs])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    for i, seq in enumerate(seqs):  # the KV rows hold each prompt as a whole prefill writes it
        seq.output_ids, seq.status = [10 + i], SeqStatus.RUNNING
    order, logits = forward.logits(seqs, {}, None)
    want = _eager(eager_kv, [(s, [10 + i], len(s.prompt_ids)) for i, s in enumerate(seqs)])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert forward.eager_started is None  # a decode graph's step


@pytest.mark.parametrize("one_pass", [True, False])
def test_grouped_chunks_short_of_their_prompts_end_still_write_their_keys(
    one_pass: bool, replays: list[object]
) -> None:
    """Four prompts prefilled in two chunks each, grouped both times: the first chunks end no prompt (no logits
    to keep), and still write their keys, which the second chunks attend to."""
    graphed_kv, eager_kv = _caches()
    forward = _graphed(graphed_kv, fold_prompt_tokens=5)  # graphs of up to 9 rows: the 16 rows do not fit one
    forward.one_pass_for_groups = one_pass
    prompts = ([5, 6, 7, 8, 1, 2, 3, 4], [4, 4, 2, 7, 1, 1, 2, 3], [3, 1, 4, 1, 5, 9, 2, 6], [9, 2, 6, 5, 3, 5, 8, 9])
    seqs = [_seq(f"p{i}", prompt, i, (-1, 0, 1, 0)[i]) for i, prompt in enumerate(prompts)]
    for seq in seqs:
        seq.prefilled = 4
    order, _ = forward.logits(seqs, {s: 4 for s in seqs}, None)
    assert order == [] and forward.grouped_prompts == 4
    for seq in seqs:
        seq.prefilled = 8
    order, logits = forward.logits(seqs, {s: 4 for s in seqs}, None)
    # (the second chunks continue their prompts: two fold into a decode graph, two make a group of one graph)
    assert order == seqs and forward.group_passes == (1 if one_pass else 0)
    want = _eager(eager_kv, [(s, s.prompt_ids, 0) for s in seqs])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


class _PendingFill:
    """Stands in for `LoRAStacks._ready[slot]`: a fill of the slot still running on the copy stream."""

    device = None

    def __repr__(self) -> str:
        return "fill"


def _with_prefill_graphs(kv: KVCache, stream: HostStream, fold_prompt_tokens: int) -> StepForward:
    stacks = _stacks(fused=True)
    config = EngineConfig(fold_prompt_tokens=fold_prompt_tokens, graph_prompt_rows=0)
    graphs = cuda_graphs.DecodeGraphs(_model(), kv, stacks, cuda_graphs.decode_graph_rows(kv.total, config), None)
    graphs.capture_all()
    prefill = cuda_graphs.PrefillGraphs(_model(), kv, stacks, None)
    prefill.capture_all()
    return StepForward(_model(), kv, stacks, CPU, graphs, prefill, stream, fold_prompt_tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize("group_prompts", [False, True])
def test_every_stream_that_reads_a_slot_waits_for_its_fill_first(
    group_prompts: bool, replays: list[object], prefill_stream: HostStream
) -> None:
    """Slot 0's fill is still running; nothing decodes; two short prompts (a group, or eager) and one for a
    prefill graph, all on slot 0. The main stream takes the wait before the prefill stream waits for it: a
    prefill graph that took the wait on its own stream left the group's replay on the main stream unordered
    with the fill (the wait is taken once)."""
    kv, _ = _caches()
    forward = _with_prefill_graphs(kv, prefill_stream, fold_prompt_tokens=5)
    forward.group_prompts = group_prompts
    a, c = _seq("a", [5, 6, 7], 0, 0), _seq("c", [4, 4, 2, 7], 1, 0)
    p = _seq("p", [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 2, 0)  # past fold_prompt_tokens: its prefill graph
    del replays[:]
    forward.stacks._ready[0] = _PendingFill()  # type: ignore[assignment]
    forward.logits([a, c, p], {a: 3, c: 4, p: 10}, None)
    stream, waited = "main", {"main": False, "prefill": False}
    for entry in replays:
        if entry in ("on prefill", "off prefill"):
            stream = "prefill" if entry == "on prefill" else "main"
        elif entry == f"{stream} waits fill":
            waited[stream] = True
        elif entry == "prefill waits main":
            waited["prefill"] |= waited["main"]
        elif entry == "main waits prefill":
            waited["main"] |= waited["prefill"]
        elif isinstance(entry, (tuple, cuda_graphs.GraphKey)):  # a replay reading slot 0
            assert waited[stream], f"{entry} replayed on {stream} before it waited for slot 0's fill: {replays}"
    assert any(isinstance(entry, cuda_graphs.GraphKey) for entry in replays) == group_prompts


def test_a_step_whose_forward_fails_still_marks_the_slots_its_queued_work_reads(replays: list[object]) -> None:
    """Graph replays were queued (reading slot 0) when the step's eager part raised: the slot's next fill must
    still wait for them (`LoRAStacks.mark_read`), or it could rewrite the slot under kernels still to run."""
    kv, _ = _caches()
    forward = _graphed(kv, fold_prompt_tokens=5)
    marked: list[set[int]] = []
    forward.stacks.mark_read = lambda slots: marked.append(set(slots))  # type: ignore[method-assign]

    def fail(*args: object) -> torch.Tensor:
        raise RuntimeError("the eager part failed")

    forward._forward_eager = fail  # type: ignore[method-assign]
    a, c = _seq("a", [5, 6, 7], 0, 0), _seq("c", [4, 4, 2, 7], 1, 0)
    e = _seq("e", [1] * 20, 2, 1)  # past fold_prompt_tokens, and no prefill graphs here: eager
    with pytest.raises(RuntimeError):
        forward.logits([a, c, e], {a: 3, c: 4, e: 20}, None)
    assert any(isinstance(key, cuda_graphs.GraphKey) for key in replays), "the group's replay was queued"
    assert marked == [{0, 1}]


def test_token_readback_never_hands_out_the_buffer_of_the_step_before() -> None:
    """A step's tokens come back into one buffer while the step before's are read from the other."""
    readback = TokenReadback(4, CPU)
    first, second, third = readback.take(3), readback.take(4), readback.take(2)
    assert first.data_ptr() != second.data_ptr() and third.data_ptr() == first.data_ptr()
    assert (len(first), len(second), len(third)) == (3, 4, 2)
    wider = readback.take(9)  # more rows than KV rows: a buffer of its own
    assert len(wider) == 9 and wider.data_ptr() not in (first.data_ptr(), second.data_ptr())

"""The forward pass of one engine step: which rows run as captured graphs and which eagerly, and their logits.

On CUDA the decoding requests run as one captured decode graph and each new prompt as a captured prefill
graph on a second stream, so the GPU overlaps them; prompts longer than the prefill buckets, and decode
batches no bucket holds, run eagerly. Without graphs (the CPU, `enforce_eager`) every row runs eagerly.

The rest of a prompt whose start is already in its KV row (a prefix-cache hit, the next chunk of a long
prompt) rides in the decode graph when the batch has room: one row per token, at its position in the prompt's
row. The decode step writes every row's keys before any row attends, and each row attends up to its own
position, so those rows are the prompt's causal prefill; only the last one's logits are kept. Eagerly, such a
few tokens would cost a whole model's kernel launches.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, PrefillGraphs, decode_graph_rows
from engine.kv_cache import KVCache
from engine.logprobs import StepLogprobs
from engine.lora import LoRAStacks
from engine.lora_batch import LoRABatch
from engine.model import DecoderModel, DecodeView, SeqSlice
from engine.prompt_logprobs import PromptRows
from engine.sequence import Sequence
from engine.uploads import upload


@dataclass(eq=False)
class InFlight:
    """A step whose tokens were sampled on the device and are not read yet (`EngineConfig.async_steps`):
    its sequences in row order and the tokens (and the log-probabilities of the rows that asked), on their way
    to host memory."""

    order: list[Sequence]
    tokens: torch.Tensor  # int64 [len(order)] on the engine's device
    host: torch.Tensor  # the same, copied without waiting (page-locked on CUDA)
    copied: torch.cuda.Event | None
    logprobs: StepLogprobs | None = None
    started: torch.cuda.Event | None = None  # recorded before the step's first device work, when timed

    @staticmethod
    def launch(
        order: list[Sequence],
        tokens: torch.Tensor,
        readback: TokenReadback,
        logprobs: StepLogprobs | None = None,
        started: torch.cuda.Event | None = None,
    ) -> InFlight:
        """Copy the step's tokens back without waiting. `started` (a timing event, `step_start_event`) times
        the step on the device."""
        if not tokens.is_cuda:
            return InFlight(order, tokens, tokens, None, logprobs)
        host = readback.take(tokens.shape[0])
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event(enable_timing=started is not None)
        copied.record()
        return InFlight(order, tokens, host, copied, logprobs, started)

    def done(self) -> bool:
        """Whether the device has finished the step: its tokens read now would not wait."""
        return self.copied is None or self.copied.query()

    def device_seconds(self) -> float | None:
        """The step's time on the device, from its first work to its tokens' copy; None where not timed.
        Call once it is done."""
        if self.started is None or self.copied is None:
            return None
        return self.started.elapsed_time(self.copied) / 1e3

    @functools.cached_property
    def rows(self) -> dict[Sequence, int]:
        """Each sequence's row in `order`."""
        return {seq: i for i, seq in enumerate(self.order)}

    def read(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()
        return list(self.host.tolist())


def step_start_event(device: torch.device) -> torch.cuda.Event | None:
    """A timing event recorded now on `device`'s current stream, ahead of a step's work (CUDA; else None)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class TokenReadback:
    """Page-locked host buffers that the tokens of a step in flight are copied into, two taken in turn.

    A step's buffer is read before the step after next launches (`LLMEngine.step` completes the step in
    flight right after launching the next one), so two never overlap. Allocating page-locked memory per
    step instead costs a `cudaHostAlloc` whenever a batch size is new to the process (the caching host
    allocator keeps blocks by size), and that call serialises the device's streams.
    """

    def __init__(self, rows: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self._buffers = [torch.empty(rows, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._turn = 0

    def take(self, rows: int) -> torch.Tensor:
        """A host buffer of `rows` tokens, not the one handed out last."""
        buffer = self._buffers[self._turn]
        self._turn ^= 1
        if rows > buffer.shape[0]:  # (a step has at most one row per KV row; kept safe all the same)
            return torch.empty(rows, dtype=torch.long, pin_memory=buffer.is_pinned())
        return buffer[:rows]


class StepTrace:
    """Phase timer for `LLMEngine.step_trace` (benchmarks only)."""

    def __init__(self, device: torch.device, misses: int) -> None:
        self.device, self.misses = device, misses  # slot misses before the step
        self.phases: list[float] = []
        self._last = time.perf_counter()

    def mark(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.phases.append(now - self._last)
        self._last = now


@dataclass(frozen=True, slots=True)
class ChunkRows:
    """Prompt chunks as decode rows, one per token at its position in its sequence's KV row (a decode graph's
    folded or grouped rows, or `DecoderModel.rows`), after `first` rows of something else."""

    ids: list[int]
    positions: list[int]
    kv_slots: list[int]
    lora_slots: list[int]
    ends: list[int]  # the rows (counted from 0, after the `first`) of the chunks that end their prompts

    @staticmethod
    def of(seqs: list[Sequence], prefills: dict[Sequence, int], first: int = 0) -> ChunkRows:
        rows = ChunkRows([], [], [], [], [])
        for seq in seqs:
            past, end = seq.prefilled - prefills[seq], seq.prefilled
            rows.ids.extend(seq.prompt_ids[past:end])
            rows.positions.extend(range(past, end))
            rows.kv_slots.extend([seq.kv_slot] * (end - past))
            rows.lora_slots.extend([seq.lora_slot] * (end - past))
            if seq.prefill_done:
                rows.ends.append(first + len(rows.ids) - 1)
        return rows


class StepForward:
    """Runs a step's rows through the model: graphs where one was captured for them, eagerly otherwise.

    `graphs` and `prefill_graphs` may be set to None at any time (benchmarks compare graphed and eager steps).
    """

    def __init__(
        self,
        model: DecoderModel,
        kv: KVCache,
        stacks: LoRAStacks,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
        prefill_graphs: PrefillGraphs | None = None,
        prefill_stream: torch.cuda.Stream | None = None,
        fold_prompt_tokens: int = 0,
    ) -> None:
        self.model, self.kv, self.stacks, self.device = model, kv, stacks, device
        self.graphs, self.prefill_graphs = graphs, prefill_graphs
        self._prefill_stream = prefill_stream  # prefill graphs replay on it, beside the decode graph
        self.fold_prompt_tokens = fold_prompt_tokens  # whole prompts up to this long join as decode rows
        self.folded_rows = 0  # prompt tokens run as rows of a decode graph (tests, benchmarks)
        self.folded_prompts = 0  # of which whole prompts, from their start
        self.eager_runs = 0  # forward passes run eagerly, no captured graph holding their rows (benchmarks)
        self.grouped_prompts = 0  # prompt chunks run together as the rows of decode graphs of their own
        self.group_prompts = True  # (`_prompt_groups`; benchmarks compare with prefill graphs one prompt each)
        # Prompt groups of more than one graph's rows run as one eager pass over all their rows, which reads the
        # model once for all of them (benchmarks compare with a graph replay per group).
        self.one_pass_for_groups = True
        self.group_passes = 0  # those eager passes (tests, benchmarks)
        # When this step's first eager pass beside the captured graphs began (`time.perf_counter`; a prompt
        # group's one pass, rows no graph held), None in a step of replays only: the engine's pacer times the
        # step's composition up to it (`LLMEngine.step`).
        self.eager_started: float | None = None
        # The last step's rows that predict prompt tokens of the requests asking for prompt log-probabilities.
        self.prompt_rows: list[PromptRows] = []
        self.readback = TokenReadback(kv.total, device)  # where async steps' tokens come back to the host

    @classmethod
    def build(
        cls,
        model: DecoderModel,
        kv: KVCache,
        stacks: LoRAStacks,
        device: torch.device,
        config: EngineConfig,
        *,
        graphed: bool,
    ) -> StepForward:
        """The engine's forward: with `graphed` (CUDA), decode and prefill graphs captured for every bucket now,
        and the stream prefill graphs replay on."""
        if not graphed:
            return cls(model, kv, stacks, device, fold_prompt_tokens=config.fold_prompt_tokens)
        graphs = DecodeGraphs(model, kv, stacks, decode_graph_rows(kv.total, config), torch.cuda.graph_pool_handle())
        graphs.capture_all()
        # Prefills replay on their own stream, concurrently with the decode graph: their own memory pool.
        prefill_graphs = PrefillGraphs(model, kv, stacks, torch.cuda.graph_pool_handle())
        prefill_graphs.capture_all()
        stream = torch.cuda.Stream(device)
        return cls(model, kv, stacks, device, graphs, prefill_graphs, stream, config.fold_prompt_tokens)

    def logits(
        self,
        running: list[Sequence],
        prefills: dict[Sequence, int],
        previous: InFlight | None,
        trace: StepTrace | None = None,
    ) -> tuple[list[Sequence], torch.Tensor]:
        """`_logits` (below), with the slots its rows read marked as read by this step's work (the slots' next
        fills wait for it: `LoRAStacks.mark_read`), also when it raises after queueing some of that work."""
        slots = {s.lora_slot for s in running if s.lora_slot >= 0}
        # Every row's fill first, on this stream: the prefill stream, which waits for this one below, then
        # inherits it (a wait on a slot's fill is taken once: had a prefill graph taken it on its own stream,
        # the decode rows on this one would not wait).
        self.stacks.wait_ready(slots)
        self.eager_started = None
        try:
            return self._logits(running, prefills, previous, trace)
        finally:
            # After every row's forward on this stream: a prefill graph's rows too, which it waited for.
            self.stacks.mark_read(slots)

    def _logits(
        self,
        running: list[Sequence],
        prefills: dict[Sequence, int],
        previous: InFlight | None,
        trace: StepTrace | None,
    ) -> tuple[list[Sequence], torch.Tensor]:
        """The rows of `running` that get a token this step, in the order their logits come, and the logits
        [rows, vocab].

        `prefills` are the sequences this step prefills and how many prompt tokens, ending at `seq.prefilled`
        (`Scheduler.schedule`); a chunk short of its prompt's end gets no row. The others decode one token,
        read from `previous` where the step that sampled it is still in flight. The logits of prompt positions
        of requests that ask for prompt log-probabilities go to `prompt_rows`.
        """
        self.prompt_rows = []
        order: list[Sequence] = []
        parts: list[torch.Tensor] = []
        eager = list(running)
        prefilled: list[tuple[Sequence, torch.Tensor]] = []
        decoding = [s for s in running if s not in prefills]
        # Chosen first: a whole prompt that runs as decode rows replays no prefill graph.
        chunks = [s for s in running if s in prefills]
        folded = self._foldable(decoding, chunks, prefills) if self.graphs is not None else []
        unfolded = [s for s in chunks if s not in folded]
        one_pass, groups = self._prompt_groups(unfolded, prefills) if self.graphs is not None else ([], [])
        grouped = {s for group in [one_pass, *groups] for s in group}
        # A prefill graph yields the last position's logits only: prompts that want them all run eagerly.
        whole = [
            s
            for s in running
            if s in prefills
            and prefills[s] == len(s.prompt_ids)
            and not s.wants_prompt_logprobs
            and s not in folded
            and s not in grouped
        ]
        if self.prefill_graphs is not None and self._prefill_stream is not None and whole:
            # Enqueued first, on a second stream: the GPU runs these prefills alongside the decode graph
            # below (both are chains of small kernels), so joining requests barely delay the running ones.
            # A prompt's chunk past its start reads the keys before it: the decode graph's rows, or eagerly.
            main = torch.cuda.current_stream(self.device)
            self._prefill_stream.wait_stream(main)
            with torch.cuda.stream(self._prefill_stream):
                for seq in whole:
                    logits = self.prefill_graphs.run(seq.prompt_ids, seq.kv_slot, seq.lora_slot)
                    if logits is not None:
                        prefilled.append((seq, logits))
                        eager.remove(seq)
        if self.graphs is not None:
            chunk = ChunkRows.of(folded, prefills, first=len(decoding))
            logits = self._decode_graphed(decoding, previous, chunk) if decoding or folded else None
            if logits is not None:
                if folded:
                    kept = upload(list(range(len(decoding))) + chunk.ends, torch.long, logits.device)
                    logits = logits.index_select(0, kept)
                    self.folded_rows += len(chunk.ids)
                    self.folded_prompts += sum(s.prefilled == prefills[s] for s in folded)
                order, parts = decoding + [s for s in folded if s.prefill_done], [logits]
                eager = [s for s in eager if s in prefills and s not in folded]
            if groups and parts:  # the replays below rewrite the graphs' shared output, which `logits` may view
                parts = [parts[0].clone()]
            if one_pass:
                # More rows than a graph holds: one eager pass over them all, where each graph replay read the
                # whole model for its own rows (a burst of 64 prompts of 37 tokens: 21 replays of 3 prompts).
                # It runs when no chunk ends its prompt too: it writes their keys.
                self._eager_starts()
                logits = self._group_pass(one_pass, prefills)
                done = [s for s in one_pass if s.prefill_done]
                if done:
                    parts.append(logits)
                    order = order + done
                eager = [s for s in eager if s not in one_pass]
                self.grouped_prompts += len(one_pass)
            for group in groups:
                chunk = ChunkRows.of(group, prefills)
                logits = self._decode_graphed([], None, chunk)
                if logits is None:  # (no bucket holds it: its prompts stay eager)
                    continue
                if chunk.ends:
                    parts.append(logits.index_select(0, upload(chunk.ends, torch.long, logits.device)))
                    order = order + [s for s in group if s.prefill_done]
                eager = [s for s in eager if s not in group]
                self.grouped_prompts += len(group)
        if trace:
            trace.mark()
        if prefilled and self._prefill_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._prefill_stream)
            order, parts = order + [s for s, _ in prefilled], parts + [t for _, t in prefilled]
        if trace:
            trace.mark()
        if eager:
            self._eager_starts()
            logits = self._forward_eager(eager, prefills, previous)
            if self.prompt_rows:  # past the last rows: those of prompt positions (`_forward_eager`)
                logits, rest = logits[: len(eager)], logits[len(eager) :]
                start = 0
                for part in self.prompt_rows:
                    part.logits = rest[start : start + len(part.targets)]
                    start += len(part.targets)
            keep = [i for i, s in enumerate(eager) if s.prefill_done]
            if len(keep) < len(eager):  # drop the rows of chunks short of their prompt's end
                logits = logits.index_select(0, upload(keep, torch.long, logits.device))
            order, parts = order + [eager[i] for i in keep], [*parts, logits]
        if trace:
            trace.mark()
        if not parts:
            return order, torch.empty(0, 0, device=self.device)
        return order, parts[0] if len(parts) == 1 else torch.cat(parts)

    def _decode_inputs(
        self, seqs: list[Sequence], previous: InFlight | None
    ) -> tuple[list[int] | torch.Tensor, list[int]]:
        """Input token and position of each decoding sequence: its last token on the host, or on the device
        while the step that sampled it is in flight (one position further then)."""
        if previous is None:
            return [s.output_ids[-1] for s in seqs], [s.context_len - 1 for s in seqs]
        index = upload([previous.rows[s] for s in seqs], torch.long, self.device)
        return previous.tokens.index_select(0, index), [s.context_len for s in seqs]

    def _eager_starts(self) -> None:
        """Note that an eager pass starts now, where graphs hold the other rows (`eager_started`): its launches
        take the engine thread milliseconds on a large model, and the device runs its kernels as they come."""
        if self.graphs is not None and self.eager_started is None:
            self.eager_started = time.perf_counter()

    def _foldable(
        self, decoding: list[Sequence], chunks: list[Sequence], prefills: dict[Sequence, int]
    ) -> list[Sequence]:
        """Those of `chunks` (prefilled this step) to run as rows of the decode graph beside `decoding`, in order,
        while the largest graph has room: a chunk that continues a prompt already in its KV row (else it would
        run eagerly), and, while others decode, a prompt of up to `fold_prompt_tokens` from its start (else a
        prefill graph beside the decode graph would read the weights a second time). Not those asking for
        prompt log-probabilities: the graph keeps only a chunk's last row."""
        assert self.graphs is not None
        room = self.graphs.batches[-1] - len(decoding)
        folded = []
        for seq in chunks:
            past = seq.prefilled - prefills[seq]
            short = bool(decoding) and prefills[seq] <= self.fold_prompt_tokens
            if (past > 0 or short) and prefills[seq] <= room and not seq.wants_prompt_logprobs:
                folded.append(seq)
                room -= prefills[seq]
        return folded

    def _group_pass(self, seqs: list[Sequence], prefills: dict[Sequence, int]) -> torch.Tensor:
        """Logits of the last row of each of `seqs`' prompt chunks that ends its prompt, from one eager pass over
        all of the chunks' rows as decode rows (`DecoderModel.rows`)."""
        self.group_passes += 1
        chunk = ChunkRows.of(seqs, prefills)
        dev = self.device
        inputs = upload(chunk.ids + chunk.positions + chunk.kv_slots, torch.long, dev).view(3, len(chunk.ids))
        view = DecodeView.of_buffers(inputs[2], inputs[1], max(chunk.positions) + 1)
        lora = LoRABatch.build(self.stacks, chunk.lora_slots, dev)
        return self.model.rows(inputs[0], view, self.kv, lora, upload(chunk.ends, torch.long, dev))

    def _prompt_groups(
        self, chunks: list[Sequence], prefills: dict[Sequence, int]
    ) -> tuple[list[Sequence], list[list[Sequence]]]:
        """The prompt chunks of this step that no decode row took (`_foldable`) and that run together, where at
        least two are up to `fold_prompt_tokens` long: all of them in one eager pass (`_group_pass`; the first
        list) where their rows are more than one decode graph holds and rows attend to keys in place (triton
        attention; the torch path gathers each row's keys, rows x context), else packed into the rows of
        decode graphs of their own (groups of two or more; the second list). Either reads the weights once for
        many prompts, where a prefill graph reads them once per prompt: 64 requests arriving together replayed
        64 prefill graphs in one step (207 ms at Llama-7B dims, 16 layers, on an H100; 38 ms in one pass:
        bench/RESULTS-gpu.md, stop 40), and joins that came together lengthened the step of the requests
        decoding beside them by one whole-model read each. A chunk past its prompt's start attends to the keys
        before it in its KV row, as a folded one does; one asking for prompt log-probabilities stays out (a
        graph keeps only a chunk's last row)."""
        assert self.graphs is not None
        fits = [s for s in chunks if prefills[s] <= self.fold_prompt_tokens and not s.wants_prompt_logprobs]
        if len(fits) < 2 or not self.group_prompts:
            return [], []
        room = self.graphs.batches[-1]
        in_place = self.device.type != "cuda" or self.model.triton_attention
        if self.one_pass_for_groups and in_place and sum(prefills[s] for s in fits) > room:
            return fits, []
        groups: list[list[Sequence]] = [[]]
        used = 0
        for seq in fits:
            if used + prefills[seq] > room and groups[-1]:
                groups.append([])
                used = 0
            groups[-1].append(seq)
            used += prefills[seq]
        # One prompt left over replays its prefill graph, beside the decode graph, as any lone prompt does.
        return [], [group for group in groups if len(group) > 1]

    def _decode_graphed(self, seqs: list[Sequence], previous: InFlight | None, chunk: ChunkRows) -> torch.Tensor | None:
        """Logits of a decode graph's rows: one per sequence of `seqs`, then `chunk`'s prompt rows, or None when no
        captured graph holds them."""
        assert self.graphs is not None
        input_ids, positions = self._decode_inputs(seqs, previous)
        kv_slots, lora_slots = [s.kv_slot for s in seqs], [s.lora_slot for s in seqs]
        if chunk.ids:
            positions = [*positions, *chunk.positions]
            kv_slots += chunk.kv_slots
            lora_slots += chunk.lora_slots
            if isinstance(input_ids, torch.Tensor):  # the decoding rows' tokens are on the device, in flight
                ids = upload([0] * len(seqs) + chunk.ids, torch.long, self.device)
                ids[: len(seqs)].copy_(input_ids)
                input_ids = ids
            else:
                input_ids = input_ids + chunk.ids
        return self.graphs.run(input_ids, positions, kv_slots, lora_slots)

    def _forward_eager(
        self, seqs: list[Sequence], prefills: dict[Sequence, int], previous: InFlight | None
    ) -> torch.Tensor:
        self.eager_runs += 1
        decoding = [s for s in seqs if s not in prefills]
        decode_ids, decode_positions = self._decode_inputs(decoding, previous)
        input_ids: list[int] = []
        positions: list[int] = []
        token_slots: list[int] = []
        slices: list[SeqSlice] = []
        decode_rows: list[int] = []
        prompt_rows: list[int] = []
        for seq in seqs:
            start = len(input_ids)
            if seq in prefills:
                past, end = seq.prefilled - prefills[seq], seq.prefilled
                input_ids.extend(seq.prompt_ids[past:end])
                positions.extend(range(past, end))
                slices.append(SeqSlice(seq.kv_slot, start, end - past, end))
                if seq.wants_prompt_logprobs:
                    # Position q predicts prompt token q + 1; the prompt's last position, the first output token.
                    stop = min(end, len(seq.prompt_ids) - 1)
                    if stop > past:
                        prompt_rows.extend(range(start, start + stop - past))
                        targets = seq.prompt_ids[past + 1 : stop + 1]
                        self.prompt_rows.append(PromptRows(seq, targets, torch.empty(0)))
            else:
                i = len(decode_rows)
                decode_rows.append(start)
                input_ids.append(0 if isinstance(decode_ids, torch.Tensor) else decode_ids[i])
                positions.append(decode_positions[i])
                slices.append(SeqSlice(seq.kv_slot, start, 1, decode_positions[i] + 1))
            token_slots.extend([seq.lora_slot] * (len(input_ids) - start))
        dev = self.device
        ids = upload(input_ids, torch.long, dev)
        if isinstance(decode_ids, torch.Tensor) and decode_rows:  # tokens of the step in flight, on the device
            ids.index_copy_(0, upload(decode_rows, torch.long, dev), decode_ids.to(ids.dtype))
        lora = LoRABatch.build(self.stacks, token_slots, dev)
        return self.model(ids, upload(positions, torch.long, dev), slices, self.kv, lora, prompt_rows or None)

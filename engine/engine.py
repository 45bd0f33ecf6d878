"""The engine: owns model, KV cache, adapter pool and scheduler, and runs steps on its own thread.

`add_request` / `abort` / adapter calls are thread-safe; they validate at once (so callers get a precise
error), then hand work to the engine thread, which applies it between steps. Outputs are delivered to each
request's sink from the engine thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import interpreter, prompt_logprobs
from engine.adapter_loader import loader_gpu_bytes, make_loader
from engine.adapters import AdapterError
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, PrefillGraphs
from engine.errors import EngineError, prompt_too_long
from engine.eviction import DecayedFrequencyPolicy, LRUPolicy
from engine.kv_cache import KVCache, kv_slots
from engine.loader import load_weights, resolve_model
from engine.logprobs import TokenLogprobs, read_logprobs
from engine.lora import LoRAStacks
from engine.model import DecoderModel
from engine.outputs import Ending, final_output, take_token
from engine.pool import AdapterCacheStats, AdapterPool, AdapterVersion
from engine.prefix_cache import PrefixCache
from engine.sampling import SamplingParams, make_generator
from engine.scheduler import Scheduler
from engine.sequence import OutputSink, SeqStatus, Sequence
from engine.step_forward import InFlight, StepForward, StepTrace, step_start_event
from engine.step_pacing import ComposePacer
from engine.step_sampling import sample_step
from engine.structured import StructuredOutputs
from engine.tokenizer import IncrementalDecoder, Tokenizer
from engine.warm_up import warm_up

log = logging.getLogger("engine")


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int
    waiting: int
    kv_slots_total: int
    kv_slots_used: int
    steps: int
    tokens_generated: int
    adapter_cache: AdapterCacheStats
    # Prompt tokens of the requests admitted so far, and those of them read from the prefix cache.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class LLMEngine:
    """Continuous-batching multi-LoRA engine over one base model."""

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.device, self.dtype = config.torch_device(), config.torch_dtype()
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        source = resolve_model(config.model)
        self.model_name = source.name
        arch, state = load_weights(source)
        self.arch = arch
        self.tokenizer = Tokenizer(source)
        self.structured = StructuredOutputs(self.tokenizer, arch.vocab_size)
        self.max_model_len = min(config.max_model_len, arch.max_position)
        model = DecoderModel(arch)
        model.load_state(state)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.model.use_triton_attention(self.device.type == "cuda" and config.attention_backend != "torch")
        self.stacks = LoRAStacks(
            arch,
            config.lora_slots,
            config.max_lora_rank,
            self.dtype,
            self.device,
            fold_shrinks=config.fold_lora_shrinks == "on",
            lora_gemm=config.lora_gemm != "off",
            lora_gemm_few=config.lora_gemm == "on",
            layered_fills=config.layered_fills == "on",
        )
        # The device loader's buffers are taken at the first load, after the cache has taken free memory.
        reserved = loader_gpu_bytes(config, self.device, self.dtype, self.stacks.layout)
        slots = kv_slots(config, arch, self.max_model_len, self.dtype, self.device, reserved)
        self.kv = KVCache(arch, slots, self.max_model_len, self.dtype, self.device)
        eviction = LRUPolicy() if config.adapter_eviction == "lru" else DecayedFrequencyPolicy()
        loader, self._arena = make_loader(config, self.device, self.dtype, self.stacks.layout)
        self.pool = AdapterPool(arch, self.stacks, self.dtype, config.host_adapter_cache, eviction, loader, self._arena)
        self.pool.on_loaded.append(self._wake)
        self.prefix_cache = PrefixCache(self.kv, enabled=config.prefix_caching == "on")
        self.scheduler = Scheduler(self.kv, self.pool, config.max_num_batched_tokens, self.prefix_cache)
        graphed = self.device.type == "cuda" and not config.enforce_eager
        self.forward = StepForward.build(self.model, self.kv, self.stacks, self.device, config, graphed=graphed)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pending = 0  # requests accepted but not yet seen by the engine thread
        self._drain_deadline: float | None = None  # set once the engine drains (`request_drain`)
        self._live: dict[str, Sequence] = {}
        self.steps = 0
        self.tokens_generated = 0
        # Async steps launched after the device had finished the step in flight before them: the device
        # waited for the engine thread (benchmarks).
        self.dry_launches = 0
        # Benchmarks set a list here to get each step's phases: (schedule, decode, prefill, eager, sample)
        # seconds and (admitted, slot misses); each phase ends with a device sync while it is set.
        self.step_trace: list[tuple[tuple[float, ...], tuple[int, int]]] | None = None
        # Sample on the device, launch the next step, then read the tokens (`EngineConfig.async_steps`).
        self.async_steps = config.async_steps == "on" or (config.async_steps == "auto" and graphed)
        self.fills_ahead = config.adapter_fills_ahead
        self._inflight: InFlight | None = None
        # Async steps: the next step is composed late in the step in flight, or at once when something arrives
        # (`EngineConfig.compose_late`); benchmarks may set it to None. `_inflight_since`: when the step in
        # flight started on the device, by the engine thread's clock.
        late = self.async_steps and config.compose_late != "off"
        self.pacer = ComposePacer(by_kind=config.compose_late == "by-kind") if late else None
        self._inflight_since = 0.0
        # Whether the step in flight ran an eager pass: the device ran it as it was launched, before
        # `_inflight_since`, so its end tells the pacer nothing of a step's time.
        self._inflight_eager = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._settled = self.device.type == "cuda"  # only a GPU engine's step loop is Python-bound
        if config.warm_up == "on" or (config.warm_up == "auto" and graphed):
            warm_up(self)  # the first real requests should pay no one-time costs of the step path
        if self._settled:
            interpreter.settle_for_serving(config.gil_switch_interval_ms)

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The captured decode steps (CUDA without `enforce_eager`); None runs decoding eagerly."""
        return self.forward.graphs

    @graphs.setter
    def graphs(self, graphs: DecodeGraphs | None) -> None:
        self.forward.graphs = graphs

    @property
    def prefill_graphs(self) -> PrefillGraphs | None:
        """The captured single-prompt prefills; None runs prefills eagerly."""
        return self.forward.prefill_graphs

    @prefill_graphs.setter
    def prefill_graphs(self, graphs: PrefillGraphs | None) -> None:
        self.forward.prefill_graphs = graphs

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Run the step loop on a background thread (tests, embedding); see `run` for serving."""
        self._thread.start()

    def run(self) -> None:
        """Run the step loop on the calling thread until `stop()`.

        The engine process calls this from its main thread: on the CPU, torch's OpenMP kernels run a
        decode step about 1.4x faster there than from a secondary thread (measured on SmolLM2).
        """
        self._run()

    def run_until_idle(self) -> None:
        """Step on the calling thread until nothing is running or startable (benchmarks, scripts)."""
        while True:
            self._drain_commands()
            self._reap()
            if not self.scheduler.has_work():
                return
            self.step()

    def request_stop(self) -> None:
        """Ask the step loop to return (safe from a signal handler)."""
        self._stop.set()
        self._wake()

    def request_drain(self, timeout_s: float) -> None:
        """Refuse new requests (UNAVAILABLE), finish those in flight, then return from the step loop; requests
        still unfinished after `timeout_s` end with an error. Safe from a signal handler (SIGTERM)."""
        self._drain_deadline = time.monotonic() + timeout_s
        self._wake()

    @property
    def draining(self) -> bool:
        """Whether `request_drain` was called: new requests are refused while those in flight finish."""
        return self._drain_deadline is not None

    def stop(self) -> None:
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.pool.close()
        if self._arena is not None:
            self._arena.close()
        if self._settled:
            self._settled = False
            interpreter.restore()

    # -- requests (any thread) ---------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: str | None,
        sink: OutputSink,
        priority: int = 0,
        cache_salt: str = "",
    ) -> None:
        """Admit a request (raises EngineError); its outputs go to `sink` from the engine thread. It reads
        prefix-cached tokens only of requests with the same `cache_salt`."""
        if not request_id:
            raise EngineError("INVALID_ARGUMENT", "request_id must not be empty")
        try:
            params.validate(self.arch.vocab_size)
            kind, spec = params.structured_kind, params.structured_spec
            grammar = self.structured.grammar(kind, spec) if kind else None  # xgrammar's reason if it won't compile
        except ValueError as exc:
            raise EngineError("INVALID_ARGUMENT", str(exc)) from exc
        if not prompt_ids:
            raise EngineError("INVALID_ARGUMENT", "the prompt is empty")
        if any(t < 0 or t >= self.arch.vocab_size for t in prompt_ids):
            raise EngineError("INVALID_ARGUMENT", f"prompt token ids must be within [0, {self.arch.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise prompt_too_long(len(prompt_ids), self.max_model_len)
        version: AdapterVersion | None = None
        if adapter:
            version = self.pool.lookup(adapter)
            if version is None:
                raise EngineError("NOT_FOUND", f"adapter {adapter!r} is not registered on this engine")
            failure = self.pool.failure(version)
            if failure is not None:
                raise EngineError("UNAVAILABLE", f"adapter {adapter!r} failed to load: {failure}")
        seq = Sequence(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            adapter=version,
            sink=sink,
            decoder=IncrementalDecoder(self.tokenizer, prompt_ids),
            generator=make_generator(params, self.device),
            priority=priority,
            cache_salt=cache_salt,
            grammar=grammar,
        )
        with self._lock:
            if self._drain_deadline is not None:
                raise EngineError("UNAVAILABLE", "the engine is shutting down; send the request to another one")
            if request_id in self._live:
                raise EngineError("INVALID_ARGUMENT", f"request id {request_id!r} is already in use")
            if len(self.scheduler.waiting) + self._pending >= self.config.max_waiting:
                raise EngineError(
                    "RESOURCE_EXHAUSTED",
                    f"{self.config.max_waiting} requests are already waiting for KV memory; retry later",
                )
            self._live[request_id] = seq
            self._pending += 1
        if version is not None:
            self.pool.ready(version)  # start the cold load now, not at the next step
        self._commands.put(lambda: self._admit(seq))
        self._wake()

    def abort(self, request_id: str) -> bool:
        """Stop a request; its sink receives a final output with finish_reason "abort"."""
        with self._lock:
            seq = self._live.get(request_id)
            if seq is None:
                return False
            seq.aborted = True
        self._wake()
        return True

    # -- adapters (any thread) ---------------------------------------------------------------------

    def load_adapter(self, name: str, path: str, pin: bool = False, wait: bool = False) -> AdapterVersion:
        if not name:
            raise EngineError("INVALID_ARGUMENT", "adapter name must not be empty")
        try:
            version = self.pool.register(name, Path(path), pin)
            if wait:
                self.pool.wait_loaded(version, timeout=120)
        except AdapterError as exc:
            raise EngineError("INVALID_ARGUMENT", str(exc)) from exc
        except TimeoutError as exc:  # a check or load queued behind many others: the adapter may still be fine
            raise EngineError("DEADLINE_EXCEEDED", str(exc) or f"adapter {name!r}: its check timed out") from exc
        self._wake()
        return version

    def unload_adapter(self, name: str) -> bool:
        return self.pool.unregister(name)

    def stats(self) -> EngineStats:
        with self._lock:
            waiting = len(self.scheduler.waiting) + self._pending
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=waiting,
            kv_slots_total=self.kv.total,
            kv_slots_used=self.kv.used_slots,
            steps=self.steps,
            tokens_generated=self.tokens_generated,
            adapter_cache=self.pool.cache_stats(),
            prefix_cache_queries=self.prefix_cache.queried_tokens,
            prefix_cache_hits=self.prefix_cache.hit_tokens,
        )

    # -- engine thread -----------------------------------------------------------------------------

    def _wake(self) -> None:
        self._wakeup.set()

    def _admit(self, seq: Sequence) -> None:
        # Under the lock with the count it moves from: `add_request` reads both to bound the waiting requests,
        # and a list being sorted reads as empty.
        with self._lock:
            self._pending -= 1
            self.scheduler.add(seq)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain_commands()
                self._reap()
                if self._drain_deadline is not None and self._drained():
                    return
                if not self.scheduler.has_work():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
            except Exception as exc:  # outside a step too: the thread must live on, or every request would hang
                log.exception("engine loop failed")
                self._fail_all(f"engine loop failed: {exc!r}", list(self.scheduler.waiting))
                continue
            try:
                self.step()
            except Exception as exc:  # a bug must fail the requests in flight, not the process
                log.exception("engine step failed")
                self._fail_all(f"engine step failed: {exc!r}")

    def _drained(self) -> bool:
        """While draining: whether every request has ended, those past the deadline with an error."""
        with self._lock:
            if not self._live:
                return True
        assert self._drain_deadline is not None
        if time.monotonic() < self._drain_deadline:
            return False
        self._fail_all("the engine shut down before the request finished", list(self.scheduler.waiting))
        return True

    def _fail_all(self, error: str, also: list[Sequence] | None = None) -> None:
        """End the running requests (and `also`) with `error`; a sink that raises cannot stop the others."""
        for seq in list(self.scheduler.running) + (also or []):
            try:
                self._finish(seq, "error", error=error)
            except Exception:
                log.exception("could not end request %s", seq.request_id)
                if seq.status is not SeqStatus.FINISHED:
                    self.scheduler.finish(seq, keep_kv=False)
                with self._lock:
                    self._live.pop(seq.request_id, None)

    def _drain_commands(self) -> None:
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def _reap(self) -> None:
        """Finish aborted requests and waiting ones whose adapter failed to load or was unloaded."""
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            if seq.aborted:
                self._finish(seq, "abort")
            elif seq.status is SeqStatus.WAITING and seq.adapter is not None and self.pool.failure(seq.adapter):
                self._finish(seq, "error", error=f"adapter {seq.adapter.name!r} failed to load: {seq.adapter.error}")
            elif seq.status is SeqStatus.WAITING and seq.adapter is not None and self.pool.current(seq.adapter) is None:
                self._finish(
                    seq, "error", error=f"adapter {seq.adapter.name!r} was unloaded before the request started"
                )

    def step(self) -> None:
        """One step: prefill newly admitted requests (and the next chunks of long prompts), decode one token for
        all running ones past their prefill (the forward pass, graphed or eager: `StepForward`).

        With `async_steps` the step's tokens stay on the device: the next step reads its inputs from there,
        and the engine thread handles this step's tokens (detokenizing, stop checks, outputs) while the GPU
        already runs the next one. The engine thread composes this step late in the one in flight, or as soon
        as a request arrives or a load ends (`pacer`, engine/step_pacing.py). A sequence that the previous step
        ended (an end token, a stop string) still decodes one row in this step, whose token is dropped; one that
        it ends by length does not. A constrained sequence (a structured output) reads its token first: its
        grammar's mask follows that token.
        """
        previous, self._inflight = self._inflight, None
        pacer = self.pacer if self.step_trace is None else None
        composing = time.perf_counter()
        if previous is not None and pacer is not None:
            # Requests that arrive while `previous` runs, and loads that end meanwhile, join this step. Timed
            # from when the composition was due, so a late wake-up (the GIL held elsewhere) counts in it.
            composing = pacer.wait(
                previous,
                self._inflight_since,
                self._wakeup,
                lambda: not self._commands.empty(),
                started_known=not self._inflight_eager,
                prompts=self.scheduler.prompts_next,
            )
            self._drain_commands()
        started = step_start_event(self.device) if pacer is not None and previous is not None else None
        trace = StepTrace(self.device, self.pool.slot_misses) if self.step_trace is not None else None
        prefills = self.scheduler.schedule()
        ending = previous.rows if previous is not None else {}
        # Rows of this step: prompt chunks, and one token for each sequence past its prefill (a prompt
        # whose next chunk did not fit this step's budget sits it out).
        running = [
            s
            for s in self.scheduler.running
            if s in prefills or (s.prefill_done and not (s in ending and self._ends_by_length(s)))
        ]
        # Rows without a token in flight, and constrained ones: read the step in flight first.
        if previous is not None and any(s not in ending or s.grammar is not None for s in running if s not in prefills):
            self._complete(previous)
            previous = None
            running = [s for s in running if s.status is SeqStatus.RUNNING]
            composing = time.perf_counter()  # the wait for the device is no part of the composition
        if not running:
            if previous is not None:
                self._complete(previous)
            return
        if trace:
            trace.mark()
        order, logits = self.forward.logits(running, prefills, previous, trace)
        prompt_logprobs.collect(self.forward.prompt_rows)
        if not order:  # only chunks short of their prompt's end: nothing to sample
            if previous is not None:
                self._complete(previous)
            return
        tokens, logprobs = sample_step(order, logits, self.tokenizer.eos_token_ids, previous)
        launched = time.perf_counter()  # the step's device work is queued
        # Its device time is its own only if it was all queued before the device ran dry; else it counts the
        # device's wait for this thread too.
        queued_ahead = previous is not None and not previous.done()
        self.dry_launches += previous is not None and not queued_ahead
        eager_started = self.forward.eager_started
        if pacer is not None:
            # A step with an eager pass beside the graphs (a burst's prompts in one pass, rows no graph holds)
            # is composed up to that pass: its launches take this thread milliseconds on a large model while the
            # device runs its kernels as they come. Timed to the end of them, one such step set the longest
            # composition of the pacer's window, which moved the next steps' deadlines to their start: a
            # request arriving while one of them ran waited for the step after the next (bench/RESULTS-gpu.md,
            # stop 43). A step composed late whose eager pass is launch-bound can still leave the device idle.
            pacer.composed((eager_started if eager_started is not None else launched) - composing, bool(prefills))
        self.steps += 1
        self._fill_ahead()
        if self.async_steps and self.step_trace is None:  # a trace times each phase up to its own tokens
            timed = started if queued_ahead else None
            self._inflight = InFlight.launch(order, tokens, self.forward.readback, logprobs, timed)
            self._inflight_eager = eager_started is not None
            # The new step starts on the device as `previous` ends (when its tokens came back, if this thread
            # waited for them), or about when it was queued if `previous` had ended by then.
            self._inflight_since = launched
            if previous is not None:
                waited = not previous.done()
                read_at = self._complete(previous)
                if waited:
                    self._inflight_since = read_at
            return
        values = tokens.tolist()
        if previous is not None:
            self._complete(previous)
        if trace and self.step_trace is not None:
            trace.mark()
            self.step_trace.append((tuple(trace.phases), (len(prefills), self.pool.slot_misses - trace.misses)))
        for seq, token, chosen in zip(order, values, read_logprobs(logprobs, len(order)), strict=True):
            self._append(seq, token, chosen)

    def _fill_ahead(self) -> None:
        """While the GPU runs the step just launched, copy the adapters of the requests next to join into
        slots (`AdapterPool.fill_ahead`); requests that arrived meanwhile are taken in first."""
        if not self.fills_ahead:
            return
        self._drain_commands()
        upcoming = [s.adapter for s in self.scheduler.upcoming() if s.adapter is not None]
        self.pool.fill_ahead(upcoming, self.fills_ahead)  # (also a hot swap's new version, with none upcoming)

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether the token in flight for `seq` ends it by max_tokens or the context length."""
        return len(seq.output_ids) + 1 >= seq.params.max_tokens or seq.context_len + 1 >= self.max_model_len

    def _complete(self, flight: InFlight) -> float:
        """Hand a step's tokens to their sequences; those finished since it was launched drop theirs. Returns
        when the tokens were read (`time.perf_counter`), before they were handed on."""
        chosen = read_logprobs(flight.logprobs, len(flight.order))
        tokens = flight.read()
        read_at = time.perf_counter()
        if self.pacer is not None:
            self.pacer.ran(flight)
        for seq, token, logprobs in zip(flight.order, tokens, chosen, strict=True):
            if seq.status is SeqStatus.RUNNING:
                self._append(seq, token, logprobs)
        return read_at

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None) -> None:
        """Hand `token` (with its `logprobs` when the request asked) to `seq`: its output, or its end."""
        if seq.params.max_tokens == 0:  # the prompt's log-probabilities alone: its first token is dropped
            self._finish(seq, "length")
            return
        result = take_token(seq, token, logprobs, self.tokenizer.eos_token_ids, self.max_model_len)
        if not isinstance(result, Ending):
            self.tokens_generated += 1
            seq.sink(prompt_logprobs.attach(seq, result))
            return
        if result.counted:
            self.tokens_generated += 1
        new_token = token if result.counted else None
        self._finish(
            seq, result.reason, text_end=result.text_end, new_token=new_token, logprobs=logprobs, error=result.error
        )

    def _finish(
        self,
        seq: Sequence,
        reason: str,
        *,
        text_end: int | None = None,
        new_token: int | None = None,
        logprobs: TokenLogprobs | None = None,
        error: str | None = None,
    ) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        self.scheduler.finish(seq, keep_kv=reason != "error")  # an error may have left its row half written
        with self._lock:
            self._live.pop(seq.request_id, None)
        out = final_output(seq, reason, text_end, new_token, logprobs if new_token is not None else None, error)
        seq.sink(prompt_logprobs.attach(seq, out))

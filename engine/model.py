"""A Llama-family decoder (Llama / SmolLM2, Qwen2 with qkv bias, Mistral) in plain torch.

Tokens of every sequence in a step are flattened into one [T] batch (prefills and decodes mixed); each
sequence's attention reads its own rows of the slot-based KV cache. LoRA deltas are added after each base
projection by `lora_batch.LoRABatch`, which knows the slot of every token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelArch
from engine.kv_cache import KVCache
from engine.lora_batch import LoRABatch
from engine.uploads import upload


@dataclass(frozen=True, slots=True)
class SeqSlice:
    """One sequence's part of a step: rows [start, start + length) of the flat batch."""

    kv_slot: int
    start: int
    length: int
    context_len: int  # tokens in the KV cache after this step (past + new)


@dataclass(frozen=True, slots=True)
class DecodeView:
    """A step where every sequence adds one token: attention for all of them in one call per layer."""

    slots: torch.Tensor  # [B] KV slot of each sequence
    positions: torch.Tensor  # [B] position of its new token
    mask: torch.Tensor  # [B, 1, 1, max_len] True where a key position is within the sequence
    max_len: int

    @staticmethod
    def of(seqs: list[SeqSlice], device: torch.device) -> DecodeView | None:
        if len(seqs) < 2 or any(s.length != 1 for s in seqs):
            return None
        lengths = upload([s.context_len for s in seqs], torch.long, device)
        max_len = max(s.context_len for s in seqs)
        mask = torch.arange(max_len, device=device)[None, :] < lengths[:, None]
        return DecodeView(
            slots=upload([s.kv_slot for s in seqs], torch.long, device),
            positions=lengths - 1,
            mask=mask[:, None, None, :],
            max_len=max_len,
        )

    @staticmethod
    def of_buffers(slots: torch.Tensor, positions: torch.Tensor, max_len: int) -> DecodeView:
        """From device tensors alone (no host values), so a CUDA graph can capture it and replay it with
        whatever the buffers hold; keys at positions <= each row's own position are attended."""
        mask = torch.arange(max_len, device=positions.device)[None, :] <= positions[:, None]
        return DecodeView(slots=slots, positions=positions, mask=mask[:, None, None, :], max_len=max_len)


@dataclass(frozen=True, slots=True)
class PrefillView:
    """A whole prompt of one sequence, padded at its end to a fixed length, described by device tensors
    (a CUDA graph replays it for any prompt that fits). Padding rows come after every real one, so causal
    attention keeps them out of the real rows; their keys land past the prompt in the sequence's own KV
    row, where decoding overwrites each position before it first attends to it."""

    slot: torch.Tensor  # [1] KV slot
    last: torch.Tensor  # [1] row of the prompt's last real token


def _chunk_mask(s: SeqSlice, device: torch.device) -> torch.Tensor | None:
    """Keys each row of a prompt chunk after the first attends: all before the chunk, and the chunk's own up to
    the row. None where SDPA's `is_causal` says as much (its mask is aligned to the first key, not the last)."""
    past = s.context_len - s.length
    if past == 0 or s.length == 1:
        return None
    rows = torch.arange(past, s.context_len, device=device)
    return torch.arange(s.context_len, device=device)[None, :] <= rows[:, None]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one fused kernel (fp32 inside) instead of eight: GPU steps are launch-bound
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x + delta, norm(x + delta))`: one triton kernel on CUDA (`engine.kernels_elementwise`), torch elsewhere."""
    if x.is_cuda:
        from engine import kernels_elementwise

        return kernels_elementwise.add_rms_norm(x, delta, norm.weight, norm.eps)
    total = x + delta
    return total, norm(total)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of the fused `[T, 2I]` gate/up output: one triton kernel on CUDA, torch elsewhere."""
    if gate_up.is_cuda:
        from engine import kernels_elementwise

        return kernels_elementwise.silu_and_mul(gate_up)
    inter = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def rope_tables(head_dim: int, max_position: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_position, head_dim] in the rotate-half layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos[:, None, :] + rotated.float() * sin[:, None, :]).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, index: int) -> None:
        super().__init__()
        self.arch, self.index = arch, index
        # CUDA: rotary and cache writes in triton, and decode attention too (engine/kernels_attention.py).
        self.triton_attention = False
        h, q, kv, i = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
        self.input_norm = RMSNorm(h, arch.rms_norm_eps)
        self.post_norm = RMSNorm(h, arch.rms_norm_eps)
        # q, k, v (and gate, up) share their input: one matmul each, LoRA deltas land in column slices.
        self.qkv_weight = nn.Parameter(torch.empty(q + 2 * kv, h), requires_grad=False)
        self.qkv_bias = nn.Parameter(torch.zeros(q + 2 * kv), requires_grad=False) if arch.qkv_bias else None
        self.o_weight = nn.Parameter(torch.empty(h, q), requires_grad=False)
        self.gate_up_weight = nn.Parameter(torch.empty(2 * i, h), requires_grad=False)
        self.down_weight = nn.Parameter(torch.empty(h, i), requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seqs: list[SeqSlice],
        kv: KVCache,
        lora: LoRABatch | None,
        view: DecodeView | PrefillView | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream `x` plus `pending` (the previous layer's MLP output, not yet added: its add is
        fused with this layer's first norm) in, with each row's position; this layer's residual stream and
        MLP output out."""
        arch = self.arch
        q_size, kv_size = arch.q_size, arch.kv_size
        x, normed, shrunk = self._norm(x, pending, self.input_norm, lora, "qkv")
        qkv = self._project("qkv", normed, self.qkv_weight, self.qkv_bias, lora, shrunk)
        tokens = x.shape[0]
        k_cache, v_cache = kv.k[self.index], kv.v[self.index]
        if isinstance(view, DecodeView) and self.triton_attention:
            attn = self._triton_decode_attention(qkv, cos, sin, k_cache, v_cache, view)
        elif isinstance(view, PrefillView) and self.triton_attention:
            attn = self._triton_prefill_attention(qkv, cos, sin, positions, k_cache, v_cache, view)
        else:
            # q and k rotate in one call (same positions): half the kernels of rotating them one by one.
            heads = arch.num_heads + arch.num_kv_heads
            qk = apply_rope(qkv[:, : q_size + kv_size].view(tokens, heads, arch.head_dim), cos, sin)
            q, k = qk[:, : arch.num_heads], qk[:, arch.num_heads :]
            v = qkv[:, q_size + kv_size :].view(tokens, arch.num_kv_heads, arch.head_dim)
            if isinstance(view, DecodeView):
                attn = self._decode_attention(q, k, v, k_cache, v_cache, view)
            elif isinstance(view, PrefillView):
                attn = self._prefill_attention(q, k, v, k_cache, v_cache, view)
            else:
                attn = self._attention(q, k, v, k_cache, v_cache, seqs)
        attn_flat = attn.reshape(tokens, q_size)
        o = self._project("o", attn_flat, self.o_weight, None, lora, False)
        x, normed, shrunk = self._norm(x, o, self.post_norm, lora, "gate_up")
        gate_up = self._project("gate_up", normed, self.gate_up_weight, None, lora, shrunk)
        hidden = lora.silu_and_mul(self.index, gate_up) if lora is not None else None
        shrunk = hidden is not None
        if hidden is None:
            hidden = silu_and_mul(gate_up)
        down = self._project("down", hidden, self.down_weight, None, lora, shrunk)
        return x, down

    def _project(
        self,
        group: str,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora: LoRABatch | None,
        shrunk: bool,
    ) -> torch.Tensor:
        """`group`'s projection of `x` plus its LoRA delta: one GEMM with the LoRA inside where the step runs
        them so (`LoRABatch.project`), else the base GEMM and then the LoRA kernels."""
        if lora is not None and not shrunk:
            y = lora.project(self.index, group, x, weight, bias)
            if y is not None:
                return y
        y = F.linear(x, weight, bias)
        if lora is not None:
            lora.apply_group(self.index, group, x, y, shrunk=shrunk)
        return y

    def _norm(
        self, x: torch.Tensor, pending: torch.Tensor | None, norm: RMSNorm, lora: LoRABatch | None, group: str
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The residual stream (plus `pending`, when given) and its norm, and whether `group`'s LoRA shrink was
        folded into the norm's kernel (`LoRABatch.norm`: CUDA decode-sized steps)."""
        if lora is not None:
            folded = lora.norm(self.index, group, x, pending, norm.weight, norm.eps)
            if folded is not None:
                return *folded, True
        if pending is None:
            return x, norm(x), False
        return *add_rms_norm(x, pending, norm), False

    @staticmethod
    def _attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seqs: list[SeqSlice],
    ) -> torch.Tensor:
        """Per-sequence attention (prefills, and steps mixing prefill and decode)."""
        attn = torch.empty_like(q)
        for s in seqs:
            rows = slice(s.start, s.start + s.length)
            past = s.context_len - s.length
            k_cache[s.kv_slot, :, past : s.context_len] = k[rows].transpose(0, 1)
            v_cache[s.kv_slot, :, past : s.context_len] = v[rows].transpose(0, 1)
            keys = k_cache[s.kv_slot, :, : s.context_len].unsqueeze(0)
            values = v_cache[s.kv_slot, :, : s.context_len].unsqueeze(0)
            queries = q[rows].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                queries,
                keys,
                values,
                attn_mask=_chunk_mask(s, q.device),
                is_causal=past == 0 and s.length > 1,
                enable_gqa=True,
            )
            attn[rows] = out[0].transpose(0, 1)
        return attn

    @staticmethod
    def _prefill_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        view: PrefillView,
    ) -> torch.Tensor:
        """One padded prompt: write its keys and values at positions [0, T) of its slot, attend causally."""
        tokens = q.shape[0]
        k_cache[view.slot, :, :tokens] = k.transpose(0, 1).unsqueeze(0)
        v_cache[view.slot, :, :tokens] = v.transpose(0, 1).unsqueeze(0)
        return DecoderLayer._causal_attention(q, k, v)

    def _triton_decode_attention(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        decode: DecodeView,
    ) -> torch.Tensor:
        """`_decode_attention` in three kernels: keys are read in place in the cache, none gathered."""
        from engine import kernels_attention

        arch = self.arch
        q = kernels_attention.rope_and_cache(
            qkv, cos, sin, k_cache, v_cache, decode.slots, decode.positions, arch.num_heads, arch.num_kv_heads
        )
        return kernels_attention.decode_attention(q, k_cache, v_cache, decode.slots, decode.positions, decode.max_len)

    def _triton_prefill_attention(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        view: PrefillView,
    ) -> torch.Tensor:
        """`_prefill_attention` with rotary and the cache writes in one kernel, SDPA over the prompt's rows."""
        from engine import kernels_attention

        arch = self.arch
        rows = torch.empty(qkv.shape[0], 2 * arch.num_kv_heads, arch.head_dim, dtype=qkv.dtype, device=qkv.device)
        q = kernels_attention.rope_and_cache(
            qkv, cos, sin, k_cache, v_cache, view.slot, positions, arch.num_heads, arch.num_kv_heads, kv_out=rows
        )
        k, v = rows[:, : arch.num_kv_heads], rows[:, arch.num_kv_heads :]
        return self._causal_attention(q, k, v)

    @staticmethod
    def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of one sequence's rows `[T, heads, D]` over themselves."""
        queries, keys, values = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1)

    @staticmethod
    def _decode_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        decode: DecodeView,
    ) -> torch.Tensor:
        """One token per sequence: write all new keys at once, attend for all sequences in one call."""
        k_cache[decode.slots, :, decode.positions] = k
        v_cache[decode.slots, :, decode.positions] = v
        keys = k_cache[decode.slots, :, : decode.max_len]
        values = v_cache[decode.slots, :, : decode.max_len]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=decode.mask, enable_gqa=True)
        return out.squeeze(2)


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.embed = nn.Parameter(torch.empty(arch.vocab_size, arch.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = (
            None
            if arch.tie_embeddings
            else nn.Parameter(torch.empty(arch.vocab_size, arch.hidden_size), requires_grad=False)
        )
        cos, sin = rope_tables(arch.head_dim, arch.max_position, arch.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def triton_attention(self) -> bool:
        """Whether the layers attend with the triton kernels (`use_triton_attention`)."""
        return any(cast(DecoderLayer, layer).triton_attention for layer in self.layers)

    def use_triton_attention(self, enabled: bool) -> None:
        """Run rotary and cache writes (decode steps and prefills) and decode attention in triton
        (`engine.kernels_attention`; CUDA only), or in torch: SDPA over each sequence's keys gathered up to
        the step's KV length."""
        for layer in self.layers:
            cast(DecoderLayer, layer).triton_attention = enabled

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a loader state dict (our names, separate q/k/v) into the fused parameters."""
        self.embed.data = state["embed"]
        self.norm.weight.data = state["norm"]
        if self.lm_head is not None:
            self.lm_head.data = state["lm_head"]
        for i, module in enumerate(self.layers):
            layer = cast(DecoderLayer, module)
            p = f"layers.{i}."
            layer.input_norm.weight.data = state[p + "input_norm.weight"]
            layer.post_norm.weight.data = state[p + "post_norm.weight"]
            layer.qkv_weight.data = torch.cat([state[p + f"{n}_proj.weight"] for n in "qkv"])
            if layer.qkv_bias is not None:
                layer.qkv_bias.data = torch.cat([state[p + f"{n}_proj.bias"] for n in "qkv"])
            layer.o_weight.data = state[p + "o_proj.weight"]
            layer.gate_up_weight.data = torch.cat([state[p + "gate_proj.weight"], state[p + "up_proj.weight"]])
            layer.down_weight.data = state[p + "down_proj.weight"]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seqs: list[SeqSlice],
        kv: KVCache,
        lora: LoRABatch | None,
        rows: list[int] | None = None,
    ) -> torch.Tensor:
        """Logits [len(seqs), vocab] for the last token of every sequence in the step, followed by those of the
        step's tokens at `rows` (indices into `input_ids`; prompt log-probabilities), in their order."""
        decode = DecodeView.of(seqs, input_ids.device)
        x = self._layers(input_ids, positions, seqs, kv, lora, decode)
        last = upload([s.start + s.length - 1 for s in seqs] + (rows or []), torch.long, x.device)
        return self._logits(x.index_select(0, last))

    @torch.inference_mode()
    def decode(
        self,
        input_ids: torch.Tensor,
        view: DecodeView,
        kv: KVCache,
        lora: LoRABatch | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, vocab] for a step of one new token per sequence, described by device tensors only
        (`DecodeView.of_buffers`): no host reads or uploads, so a CUDA graph can capture it. Written into `out`
        (fp32 [B, vocab]) when given."""
        return self._logits(self._layers(input_ids, view.positions, [], kv, lora, view), out)

    @torch.inference_mode()
    def rows(
        self, input_ids: torch.Tensor, view: DecodeView, kv: KVCache, lora: LoRABatch | None, keep: torch.Tensor
    ) -> torch.Tensor:
        """Logits [len(keep), vocab] of the rows `keep` of a pass over rows as `decode` takes them (each at its
        position in its KV row, attending up to it), run eagerly: the prompt chunks of many sequences in one
        pass, more rows than a decode graph holds (`StepForward`'s prompt groups)."""
        x = self._layers(input_ids, view.positions, [], kv, lora, view)
        return self._logits(x.index_select(0, keep))

    @torch.inference_mode()
    def prefill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, view: PrefillView, kv: KVCache, lora: LoRABatch | None
    ) -> torch.Tensor:
        """Logits [1, vocab] after one padded prompt (`PrefillView`); device tensors only, like `decode`."""
        x = self._layers(input_ids, positions, [], kv, lora, view)
        return self._logits(x.index_select(0, view.last))

    def _layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seqs: list[SeqSlice],
        kv: KVCache,
        lora: LoRABatch | None,
        view: DecodeView | PrefillView | None,
    ) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed)
        cos = cast(torch.Tensor, self.rope_cos)[positions]
        sin = cast(torch.Tensor, self.rope_sin)[positions]
        pending: torch.Tensor | None = None
        gates = {} if lora is None else lora.stacks.layer_gates
        for i, layer in enumerate(self.layers):
            gate = gates.get(i)
            if gate is not None:  # a layered fill's chunk starts here (`LoRAStacks.layered_fills`)
                torch.cuda.current_stream(x.device).wait_event(gate)
            x, pending = layer(x, pending, positions, cos, sin, seqs, kv, lora, view)
        return x if pending is None else x + pending

    def _logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        head = self.embed if self.lm_head is None else self.lm_head
        logits = F.linear(self.norm(hidden), head)
        if out is None:
            return logits.float()
        return out.copy_(logits)  # the cast to fp32 and the write in one kernel

"""The small element-wise ops of a Qwen3 layer, and a Gated DeltaNet layer's decode rows and
prefill chunks, as one swappable set.

`TorchOps` is the reference (plain torch, any device). A model runner on a GPU swaps in the fused
Triton set (batchrun.layers.triton_ops) with `use_ops`; both compute the same functions: RMSNorm
in float32, cast to the input dtype, then scaled by the weight in that dtype (as Qwen3 does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.attention.meta import padded_rows
from batchrun.layers import gated_delta


@dataclass(frozen=True)
class DecodeRows:
    """A step's decoding requests' rows, packed: request r's are rows starts[r] .. starts[r] +
    lens[r] - 1 of the step (a graph's padding requests have none), at most `width` each (a
    host bound, static in a CUDA graph)."""

    starts: torch.Tensor  # [D] int64 on the device
    lens: torch.Tensor  # [D] int64 on the device
    width: int

    def grid(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows as a [D, width] grid: each cell's packed row (in range of num_rows) and
        whether it is one of its request's rows."""
        grid, valid = padded_rows(self.starts, self.lens, self.width)
        return grid.clamp(max=max(num_rows - 1, 0)), valid


@dataclass(frozen=True)
class KeptRows:
    """A Gated DeltaNet layer's lazy commit: the verify rows a slot's acceptance kept, which its
    recurrent state takes at the start of the slot's next decode or verify step (that step reads
    the state anyway, and writes it once), not in a pass of their own after the acceptance.

    Slot s's count[s] pending rows are kv/g/beta[s, buffer[s], :count[s]]. A verify step stages
    its rows in the slot's other buffer, [s, 1 - buffer[s]], so no step overwrites the rows it
    reads; the commit then names that buffer and how many of its rows were kept (`take`), and
    every step, once all its layers have read them, clears its slots' counts (`clear`). count
    and buffer are shared by every linear layer; kv, g and beta are the layer's."""

    count: torch.Tensor  # [decode_slots] int32: rows pending
    buffer: torch.Tensor  # [decode_slots] int32: 0 or 1, the buffer that holds them
    kv: torch.Tensor  # [decode_slots, 2, max_width, C - Hk * dk] model dtype: k and v, post-conv
    g: torch.Tensor  # [decode_slots, 2, max_width, Hv] float32
    beta: torch.Tensor  # [decode_slots, 2, max_width, Hv] float32

    def take(self, slots: torch.Tensor, kept: torch.Tensor) -> None:
        """After a verify step's acceptance: slots [D] keep kept [D] rows of those it staged."""
        self.count[slots] = kept.to(self.count.dtype)
        self.buffer[slots] = 1 - self.buffer[slots]

    def clear(self, slots: torch.Tensor) -> None:
        """After a step's forward: its slots' states took their pending rows (a prefill chunk's
        slot had none of its own request's: a finished request's are dropped)."""
        self.count.index_fill_(0, slots, 0)  # a kernel: no host value to copy in a graph


class TorchOps:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the pre-norm layer's residual step."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def norm_rope(
        self,
        x: torch.Tensor,  # [T, heads, head_dim]
        weight: torch.Tensor,
        eps: float,
        cos: torch.Tensor,  # [max_positions, head_dim / 2] float32
        sin: torch.Tensor,
        positions: torch.Tensor,  # [T]
    ) -> torch.Tensor:
        """Per-head RMSNorm, then rotate-half RoPE computed in float32."""
        return self.rope(self.rms_norm(x, weight, eps), cos, sin, positions)

    def rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Rotate-half RoPE of x [T, heads, head_dim], computed in float32 (the fused set keeps
        this one: it runs only for layers without a q/k norm)."""
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    def qk_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rope of the queries and of the keys (Llama: no q/k norm)."""
        return self.rope(q, cos, sin, positions), self.rope(k, cos, sin, positions)

    def qk_norm_rope(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """norm_rope of the queries and of the keys (one kernel in the fused set)."""
        return (
            self.norm_rope(q, q_weight, eps, cos, sin, positions),
            self.norm_rope(k, k_weight, eps, cos, sin, positions),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    # A Gated DeltaNet's decode and verify rows, packed (DecodeRows), each request's state in a
    # slot (the math and its arguments: layers/gated_delta.py). The reference lays the rows
    # on a [D, width] grid for gated_delta's functions; the fused set reads them in place.
    def conv_rows(
        self,
        qkv: torch.Tensor,  # [N, C] the step's pre-conv rows
        conv: torch.Tensor,
        slots: torch.Tensor,
        rows: DecodeRows,
        weight: torch.Tensor,
        keep: torch.Tensor | None,
    ) -> torch.Tensor:
        """gated_delta.conv_rows of each request's rows: [N, C], the rows of no request
        unspecified."""
        grid, valid = rows.grid(qkv.shape[0])
        mixed = gated_delta.conv_rows(qkv[grid], conv, slots, weight, keep)
        out = torch.zeros_like(qkv)
        out[grid[valid]] = mixed[valid]
        return out

    def delta_rows(
        self,
        mixed: torch.Tensor,  # [N, C] conv_rows' output
        g: torch.Tensor,  # [N, Hv] float32
        beta: torch.Tensor,  # [N, Hv] float32
        recurrent: torch.Tensor,
        slots: torch.Tensor,
        rows: DecodeRows,
        kept: KeptRows,
        update: bool,
        num_k_heads: int,
        head_k_dim: int,
        out: torch.Tensor,  # [N, Hv, dv]: each request's outputs go to its rows
    ) -> None:
        """gated_delta.delta_rows of each request's rows, after its slot's pending kept rows
        (KeptRows), their outputs written into `out`. update: the slot takes the rows (a decode
        step); else (a verify step) it takes only its pending rows and the rows are staged."""
        key_dim = num_k_heads * head_k_dim
        count, buffer = kept.count[slots].long(), kept.buffer[slots].long()
        held = kept.kv[slots, buffer]  # [D, max_width, kv]: k and v only; the rule needs no q
        gated_delta.delta_rows(
            torch.cat((held.new_zeros(*held.shape[:2], key_dim), held), dim=-1),
            kept.g[slots, buffer],
            kept.beta[slots, buffer],
            recurrent,
            slots,
            count,
            num_k_heads,
            head_k_dim,
        )
        grid, valid = rows.grid(mixed.shape[0])
        result = gated_delta.delta_rows(
            mixed[grid],
            g[grid],
            beta[grid],
            recurrent,
            slots,
            rows.lens if update else None,
            num_k_heads,
            head_k_dim,
        )
        out[grid[valid]] = result[valid]
        if not update:
            staged = (slots, 1 - buffer, slice(0, rows.width))
            kept.kv[staged] = mixed[grid][..., key_dim:]
            kept.g[staged], kept.beta[staged] = g[grid], beta[grid]

    def prefill_chunks(
        self,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv: torch.Tensor,
        recurrent: torch.Tensor,
        slots: torch.Tensor,
        lens: tuple[int, ...],
        cu: torch.Tensor,  # [P + 1] int32 on the device: lens' offsets (the kernels' view)
        weight: torch.Tensor,
        num_k_heads: int,
        head_k_dim: int,
    ) -> torch.Tensor:
        return gated_delta.prefill_chunks(
            qkv, g, beta, conv, recurrent, slots, lens, weight, num_k_heads, head_k_dim
        )


TORCH_OPS = TorchOps()


def use_ops(module: nn.Module, ops: TorchOps) -> None:
    """Make every layer under `module` compute with `ops`."""
    for sub in module.modules():
        if hasattr(sub, "ops"):
            setattr(sub, "ops", ops)  # noqa: B010 (a plain attribute, not a submodule)

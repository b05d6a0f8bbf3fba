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
        keep: torch.Tensor | None,
        num_k_heads: int,
        head_k_dim: int,
        out: torch.Tensor | None,  # [N, Hv, dv]: each request's outputs go to its rows
    ) -> None:
        """gated_delta.delta_rows of each request's rows (with keep, its kept ones), their
        outputs written into `out` (None: a commit's, not wanted)."""
        grid, valid = rows.grid(mixed.shape[0])
        result = gated_delta.delta_rows(
            mixed[grid], g[grid], beta[grid], recurrent, slots, keep, num_k_heads, head_k_dim
        )
        if out is not None:
            if keep is not None:
                valid = valid & (torch.arange(rows.width, device=valid.device) < keep[:, None])
            out[grid[valid]] = result[valid]

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

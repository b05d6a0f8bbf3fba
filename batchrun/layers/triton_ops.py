"""The fused Triton versions of a layer's small ops (batchrun/kernels/triton_fused.py), behind
the interface of the torch reference (layers/ops.py). They write in place where they can: the
tensors they overwrite are a step's own intermediates."""

from __future__ import annotations

import torch

import batchrun.kernels.triton_fused as kernels
import batchrun.kernels.triton_gated_delta as delta_kernels
import batchrun.kernels.triton_gated_delta_chunks as chunk_kernels
from batchrun.layers.ops import DecodeRows, KeptRows, TorchOps


class TritonOps(TorchOps):
    name = "triton"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2:
            return super().rms_norm(x, weight, eps)
        return kernels.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = kernels.fused_add_rms_norm_(x, residual, weight, eps)
        return out, residual

    def norm_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        kernels.rms_norm_rope_(x, weight, cos, sin, positions, eps)
        return x

    def qk_norm_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kernels.qk_rms_norm_rope_(q, k, q_weight, k_weight, cos, sin, positions, eps)
        return q, k

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(gate_up)

    def conv_rows(
        self,
        qkv: torch.Tensor,
        conv: torch.Tensor,
        slots: torch.Tensor,
        rows: DecodeRows,
        weight: torch.Tensor,
        keep: torch.Tensor | None,
    ) -> torch.Tensor:
        return delta_kernels.conv_rows(
            qkv, conv, slots, rows.starts, rows.lens, rows.width, weight, keep
        )

    def delta_rows(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        recurrent: torch.Tensor,
        slots: torch.Tensor,
        rows: DecodeRows,
        kept: KeptRows,
        update: bool,
        num_k_heads: int,
        head_k_dim: int,
        out: torch.Tensor,
    ) -> None:
        delta_kernels.delta_rows(
            mixed,
            g,
            beta,
            recurrent,
            slots,
            rows.starts,
            rows.lens,
            (kept.count, kept.buffer, kept.kv, kept.g, kept.beta),
            update,
            num_k_heads,
            head_k_dim,
            out,
        )

    def prefill_chunks(
        self,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv: torch.Tensor,
        recurrent: torch.Tensor,
        slots: torch.Tensor,
        lens: tuple[int, ...],
        cu: torch.Tensor,
        weight: torch.Tensor,
        num_k_heads: int,
        head_k_dim: int,
    ) -> torch.Tensor:
        """Every chunk of the step in one launch per kernel, by the offsets cu."""
        mixed = chunk_kernels.conv_chunks(qkv, conv, slots, cu, weight)
        return chunk_kernels.delta_chunks(
            mixed, g, beta, recurrent, slots, cu, num_k_heads, head_k_dim
        )

"""The fused Triton versions of a layer's small ops (batchrun/kernels/triton_fused.py), behind
the interface of the torch reference (layers/ops.py). They write in place where they can: the
tensors they overwrite are a step's own intermediates."""

from __future__ import annotations

import torch

import batchrun.kernels.triton_fused as kernels
from batchrun.layers.ops import TorchOps


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

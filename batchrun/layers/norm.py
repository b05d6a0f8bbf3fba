"""RMSNorm as Qwen3 computes it: in float32, cast back to the input dtype, then weighted; and the
hybrid models' two variants (zero-centred weights, gated by silu)."""

from __future__ import annotations

import torch
from torch import nn

from batchrun.layers.ops import TORCH_OPS


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.ops = TORCH_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class ZeroCentredRMSNorm(nn.Module):
    """The hybrid models' RMSNorm (Qwen3.5, Qwen3-Next): the checkpoint stores weight - 1, and
    the float32 normalised x is scaled by (1 + weight) before the cast back, as transformers
    computes it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        residual = x + residual
        return self(residual), residual


class GatedRMSNorm(nn.Module):
    """A Gated DeltaNet's output norm over each value head: RMSNorm (weight as stored), then
    times silu(gate) in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(x.dtype) * torch.nn.functional.silu(gate.float())).to(x.dtype)

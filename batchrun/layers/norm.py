"""RMSNorm as Qwen3 computes it: in float32, cast back to the input dtype, then weighted."""

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

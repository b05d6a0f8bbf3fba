"""The SwiGLU feed-forward block of Qwen3, with gate and up projections in one matmul."""

from __future__ import annotations

import torch
from torch import nn

from batchrun.layers.fp8_linear import make_linear
from batchrun.layers.ops import TORCH_OPS


class SwiGLU(nn.Module):
    # Checkpoint tensors packed into one parameter: name -> (packed name, shard index).
    PACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(
        self, hidden: int, intermediate: int, fp8_block: tuple[int, int] | None = None
    ) -> None:
        super().__init__()
        self.gate_up_proj = make_linear(hidden, 2 * intermediate, fp8_block)
        self.gate_up_proj.shard_sizes = (intermediate, intermediate)  # type: ignore[assignment]
        self.down_proj = make_linear(intermediate, hidden, fp8_block)
        self.ops = TORCH_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))

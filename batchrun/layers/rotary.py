"""Rotary position embedding tables, neox (rotate-half) layout, in float32."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        # Computed on the host whatever the default device: on the meta device (the start-up
        # checks build models there) these ops would first import torch._dynamo, a second.
        cpu = torch.device("cpu")
        dims = torch.arange(0, head_dim, 2, dtype=torch.float32, device=cpu)
        inv_freq = 1.0 / (theta ** (dims / head_dim))
        positions = torch.arange(max_positions, dtype=torch.float32, device=cpu)
        freqs = torch.outer(positions, inv_freq)
        self.cos: torch.Tensor  # [max_positions, head_dim / 2]
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

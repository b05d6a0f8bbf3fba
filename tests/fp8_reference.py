"""FP8 arithmetic done by hand, for the kernels' tests: weights quantized per block as Qwen's
-FP8 checkpoints are, and activations as the kernels feed them to their dots."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchrun.attention.kv_dtype import FP8_MAX


def quantize_blocks(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [n, k] as float8_e4m3fn and its float32 scale per block (weight_scale_inv)."""
    n, k = weight.shape
    rows, cols = -(-n // block[0]), -(-k // block[1])
    padded = F.pad(weight.float(), (0, cols * block[1] - k, 0, rows * block[0] - n))
    amax = padded.reshape(rows, block[0], cols, block[1]).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    full = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (weight / full).to(torch.float8_e4m3fn), scale


def quantized_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the kernels feed it to the dot: per row and group of columns, scaled to FP8's range,
    rounded to float8_e4m3fn and scaled back (float32)."""
    m, k = x.shape
    groups = -(-k // group)
    g = F.pad(x.float(), (0, groups * group - k)).reshape(m, groups, group)
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return ((g / scale).to(torch.float8_e4m3fn).float() * scale).reshape(m, -1)[:, :k]

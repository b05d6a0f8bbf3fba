"""A linear layer whose weight stays in float8_e4m3fn, scaled per block (an FP8 checkpoint's
`weight` and `weight_scale_inv`, as Qwen publishes its -FP8 models).

On CUDA the matmul is block-scaled FP8 (kernels/triton_fp8.py: activations quantized per row
and block of columns on the fly). Elsewhere the weight is dequantized for each matmul, exactly
as the loader dequantizes a weight it does not keep in FP8 (weight x its block's scale, in
float32), so the CPU path computes what transformers computes on the dequantized checkpoint.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Fp8Matmul = Callable[..., torch.Tensor]

# From this many rows, cuBLAS's blockwise scaled matmul (torch._scaled_mm with 1 x 128 activation
# and 128 x 128 weight scales) is used: up to 64 rows the Triton kernel is as fast or faster,
# from 128 cuBLAS is (docs/benchmarks.md, FP8).
CUBLAS_MIN_ROWS = 65


class Fp8Linear(nn.Module):
    weight: nn.Parameter  # [out, in] float8_e4m3fn
    weight_scale_inv: nn.Parameter  # [ceil(out / block rows), ceil(in / block columns)] float32

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int]) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        rows, cols = -(-out_features // block[0]), -(-in_features // block[1])
        fp8 = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn)
        self.weight = nn.Parameter(fp8, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(rows, cols), requires_grad=False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """model.to(dtype) converts every floating tensor; this layer's keep their dtypes (the
        model is converted before it is loaded, and an fp8 value survives a trip through bf16)."""
        super()._apply(fn, recurse)
        self.weight.data = self.weight.data.to(torch.float8_e4m3fn)
        self.weight_scale_inv.data = self.weight_scale_inv.data.float()
        return self

    @property
    def shard_scale_rows(self) -> tuple[int, ...]:
        """The scale rows of each packed checkpoint tensor (their rows are whole blocks)."""
        return tuple(size // self.block[0] for size in getattr(self, "shard_sizes", ()))

    def dequantized(self) -> torch.Tensor:
        """The weight in float32, as the loader dequantizes one it does not keep."""
        rows, cols = self.weight.shape
        scale = self.weight_scale_inv.repeat_interleave(self.block[0], 0)[:rows]
        return self.weight.float() * scale.repeat_interleave(self.block[1], 1)[:, :cols]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        matmul = fp8_matmul() if x.is_cuda else None
        if matmul is None:
            return F.linear(x, self.dequantized().to(x.dtype))
        flat = x.reshape(-1, self.in_features)
        out = matmul(flat, self.weight, self.weight_scale_inv, self.block)
        return out.reshape(*x.shape[:-1], self.out_features)


def make_linear(
    in_features: int, out_features: int, fp8_block: tuple[int, int] | None
) -> nn.Linear | Fp8Linear:
    """An Fp8Linear for a checkpoint that keeps FP8 blocks, else a plain bias-free Linear."""
    if fp8_block is None:
        return nn.Linear(in_features, out_features, bias=False)
    return Fp8Linear(in_features, out_features, fp8_block)


@functools.cache
def fp8_matmul() -> Fp8Matmul | None:
    """The block-scaled FP8 matmul when triton imports, else None (dequantized matmuls)."""
    try:
        from batchrun.kernels.triton_fp8 import fp8_block_matmul
    except ImportError:
        return None

    def matmul(
        x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
    ) -> torch.Tensor:
        m, k = x.shape
        whole_blocks = block == (128, 128) and k % 128 == 0 and weight.shape[0] % 128 == 0
        if m >= CUBLAS_MIN_ROWS and whole_blocks and cublas_blockwise(x.device, x.dtype):
            return cublas_matmul(x, weight, scale)
        return fp8_block_matmul(x, weight, scale, block)

    return matmul


def cublas_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ dequantized(weight)^T by cuBLAS's blockwise scaled matmul, 128 x 128 weight blocks,
    x quantized per row and 128 columns by the Triton kernel (on CUDA, where triton imports)."""
    from batchrun.kernels.triton_fp8 import quantize_groups

    m = x.shape[0]
    rows = -(-m // 4) * 4  # cuBLAS has blockwise kernels for whole groups of 4 rows
    xq, x_scale = quantize_groups(x, 128, rows)
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.t(), out_dtype=x.dtype)
    return out[:m]


@functools.cache
def cublas_blockwise(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch and GPU run torch._scaled_mm with blockwise scales (torch >= 2.9 on
    Hopper), tried once on a small product; called in the warm-up before graph capture."""
    x = torch.zeros(128, 128, device=device, dtype=torch.float8_e4m3fn)
    w = torch.zeros(128, 128, device=device, dtype=torch.float8_e4m3fn)
    x_scale = torch.ones(1, 128, device=device).t()
    w_scale = torch.ones(1, 1, device=device)
    try:
        torch._scaled_mm(x, w.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=dtype)
    except (RuntimeError, TypeError, ValueError):
        return False
    return True

"""FP8 checkpoints (`quantization_config` with quant_method fp8, as Qwen publishes its -FP8
models): float8_e4m3fn weights, each with a float32 `weight_scale_inv` per block of
weight_block_size (Qwen: 128 x 128) or one for the whole tensor, and activations quantized
dynamically. The weights of the attention, MLP and MoE expert projections stay in FP8
(layers/fp8_linear.py, kernels/triton_moe.py: block-scaled FP8 matmuls on the GPU) where their
packed parts (and, under --tp, every rank's share) are whole blocks; every other FP8 weight
(per-tensor scales, shares that split a block) is dequantized as it is read (weight x its
block's scale, as transformers does) and runs in the job's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from batchrun.errors import JobError

SCALE_SUFFIX = "_scale_inv"  # X.weight's scale is X.weight_scale_inv
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class Fp8Scheme:
    block: tuple[int, int] | None  # rows x columns a scale covers; None: the whole tensor

    def describe(self, kept: bool) -> str:
        blocks = f"{self.block[0]} x {self.block[1]} blocks" if self.block else "per tensor"
        how = "block-scaled FP8 matmuls" if kept else "dequantized as loaded"
        return f"FP8 ({blocks}, {how})"


def fp8_scheme(config: Mapping[str, Any], what: str) -> Fp8Scheme | None:
    """The checkpoint's FP8 scheme (None: not quantized); other quantizations are refused."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method != "fp8":
        raise JobError(f"{what}: quantized checkpoints ({method}) are not supported (fp8 is)")
    if quantization.get("activation_scheme", "dynamic") != "dynamic":
        raise JobError(f"{what}: fp8 with static activation scales is not supported")
    block = quantization.get("weight_block_size")
    if block is None:
        return Fp8Scheme(None)
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise JobError(f"{what}: weight_block_size must be two positive integers, got {block!r}")
    return Fp8Scheme((block[0], block[1]))


def dequantized(
    tensors: Iterator[tuple[str, torch.Tensor]],
    scheme: Fp8Scheme,
    what: str,
    kept: Callable[[str], bool] = lambda name: False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every FP8 weight dequantized (float32) and the scales
    consumed, but the weights `kept` names, which pass with their scales as they are; a
    weight and its scale may come in either order, from different files."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if kept(name.removesuffix(SCALE_SUFFIX)):
            yield name, tensor
        elif name.endswith(SCALE_SUFFIX):
            base = name.removesuffix(SCALE_SUFFIX)
            if base in weights:
                yield base, _dequantize(base, weights.pop(base), tensor, scheme, what)
            else:
                scales[base] = tensor
        elif tensor.dtype in FP8_DTYPES:
            if name in scales:
                yield name, _dequantize(name, tensor, scales.pop(name), scheme, what)
            else:
                weights[name] = tensor
        else:
            yield name, tensor
    for name in sorted(weights):
        raise JobError(f"{what}: fp8 tensor {name!r} has no {name + SCALE_SUFFIX!r}")
    for name in sorted(scales):
        raise JobError(f"{what}: {name + SCALE_SUFFIX!r} scales no fp8 tensor")


def _dequantize(
    name: str, weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme, what: str
) -> torch.Tensor:
    if scheme.block is None:
        if scale.numel() != 1:
            raise JobError(f"{what}: {name!r} has {scale.numel()} scales; per tensor is one")
        return weight.float() * scale.float().reshape(())
    rows, cols = weight.shape
    block_rows, block_cols = scheme.block
    expected = (-(-rows // block_rows), -(-cols // block_cols))
    if tuple(scale.shape) != expected:
        raise JobError(
            f"{what}: {name + SCALE_SUFFIX!r} has shape {list(scale.shape)}, "
            f"expected {list(expected)} for {list(weight.shape)} in blocks of {list(scheme.block)}"
        )
    full = scale.float().repeat_interleave(block_rows, 0)[:rows]
    return weight.float() * full.repeat_interleave(block_cols, 1)[:, :cols]

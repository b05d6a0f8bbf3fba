"""The KV cache's dtype: the model's (`auto`), or FP8 (`fp8`: float8_e4m3fn, one byte an
element, so the same memory holds about twice the pages of a bfloat16 pool).

FP8 K and V are scaled per tensor: each target layer has one float32 scale for its K and one for
its V, a [2] tensor on the device (CUDA graphs read it there). A stored value is
clamp(x / scale, -448, 448) in float8_e4m3fn, a read one stored.float() * scale. Without a
calibration the scales are 1.0, as vLLM's are for a checkpoint that carries none: e4m3's range
(up to 448) holds Qwen3's K (after its RMSNorm) and V, and what is lost is rounding to 3 mantissa
bits. Only the target's pools are FP8: a DFlash draft's K/V (its paged layers and its rings)
stays in the model dtype, it is a few layers and what it reads decides acceptance.
"""

from __future__ import annotations

import torch

from batchrun.errors import JobError

KV_CACHE_DTYPES = ("auto", "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise JobError(f"kv_cache_dtype must be auto or fp8, got {name!r}")


def kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the target's KV pools for kv_cache_dtype `name`."""
    check_kv_cache_dtype(name)
    return FP8 if name == "fp8" else model_dtype


def kv_element_size(name: str, model_element: int) -> int:
    """Bytes per element of the target's KV pools (model_element: the model dtype's)."""
    check_kv_cache_dtype(name)
    return 1 if name == "fp8" else model_element


def kv_scales(num_layers: int, device: torch.device) -> torch.Tensor:
    """Every layer's (K scale, V scale), [num_layers, 2] float32: 1.0 (uncalibrated)."""
    return torch.ones(num_layers, 2, dtype=torch.float32, device=device)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, saturated to e4m3's range, rounded to float8_e4m3fn (nearest, ties to even)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored FP8 values as `dtype`: x.float() * scale."""
    return (x.float() * scale).to(dtype)

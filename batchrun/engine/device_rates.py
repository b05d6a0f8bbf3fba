"""The device's ceilings: its copy bandwidth and matmul rate, measured in a second. The engine
reads them at start-up to choose its batch (engine/batch_choice.py); `batchrun bench` holds steps
and jobs against them (bench/roofline.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchrun.models.qwen3 import Qwen3Shape


@dataclass(frozen=True)
class Ceilings:
    copy_bytes_per_s: float  # bytes read plus written per second, device to device
    matmul_flops_per_s: float  # dense matmul in the model's dtype
    # FP8 matmul (one scale a tensor, cuBLAS's fastest); measured for a model with FP8 weights
    fp8_matmul_flops_per_s: float | None = None

    def matmul_rate(self, shape: Qwen3Shape) -> float:
        """The rate the shape's matmuls are held to: FP8's for a checkpoint with FP8 weights."""
        if shape.fp8_block is not None and self.fp8_matmul_flops_per_s is not None:
            return self.fp8_matmul_flops_per_s
        return self.matmul_flops_per_s


def time_ms(fn: object, warmup: int = 3, repeat: int = 10) -> float:
    """Median milliseconds of fn() on the GPU, timed with CUDA events after warm-up."""
    assert callable(fn)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_ms(call: Callable[..., object], calls: int, warmup_calls: int = 1) -> float:
    """GPU milliseconds per call(i), from a CUDA graph of call(0) .. call(calls - 1) replayed
    (time_ms): no launch overhead. call(0) .. call(warmup_calls - 1) run first, outside the
    graph (compilation, probes, allocations)."""
    for i in range(warmup_calls):
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    return time_ms(graph.replay, warmup=3, repeat=10) / calls


def measure_ceilings(dtype: torch.dtype, device: torch.device, fp8: bool = False) -> Ceilings:
    """The device's copy bandwidth (1 GiB each way) and matmul rates (8,192-square products), on
    buffers freed again before it returns: the KV pages are sized after it."""
    copy_rate = _copy_rate(device)
    matmul_rate, fp8_rate = _matmul_rates(dtype, device, fp8)
    torch.cuda.empty_cache()
    return Ceilings(copy_rate, matmul_rate, fp8_rate)


def _copy_rate(device: torch.device) -> float:
    n = 1 << 30  # 1 GiB each way: far past the L2
    buffers = [torch.empty(n, dtype=torch.uint8, device=device).random_() for _ in range(2)]
    copy_ms = time_ms(lambda: buffers[1].copy_(buffers[0]))
    return 2 * n / (copy_ms / 1e3)


def _matmul_rates(
    dtype: torch.dtype, device: torch.device, fp8: bool
) -> tuple[float, float | None]:
    """The dtype's matmul rate and, with fp8, FP8's (one scale a tensor, cuBLAS's fastest)."""
    size = 8192
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    mm_ms = time_ms(lambda: a @ b)
    fp8_rate = None
    if fp8:  # else an FP8 job's compute floor, at bf16's rate, is twice too high
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b column-major
        one = torch.ones((), device=device)
        fp8_ms = time_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=dtype))
        fp8_rate = 2 * size**3 / (fp8_ms / 1e3)
    return 2 * size**3 / (mm_ms / 1e3), fp8_rate

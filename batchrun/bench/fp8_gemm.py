"""The projections of a shape as block-scaled FP8 matmuls against the bf16 matmul (cuBLAS) of
the same size, per batch of rows: the Triton kernel (kernels/triton_fp8.py) with its default
tile and with every other tile tried (the data behind tile_for), cuBLAS's blockwise scaled
matmul where this torch has one (with the activation quantization it needs), and the path
Fp8Linear takes (the data behind CUBLAS_MIN_ROWS)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from batchrun.bench.shapes import FP8_BLOCK, FP8_SCALE, random_fp8
from batchrun.engine.device_rates import graph_ms as device_graph_ms
from batchrun.kernels.triton_fp8 import Tile, fp8_block_matmul, tile_for
from batchrun.layers.fp8_linear import cublas_blockwise, cublas_matmul, fp8_matmul
from batchrun.models.qwen3 import Qwen3Shape

BLOCK = FP8_BLOCK  # Qwen's -FP8 checkpoints
COPIES = 4  # of each weight, read in turn: together past the L2 cache (50 MB)


def projections(s: Qwen3Shape) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the shape's dense projections."""
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return {
        "qkv_proj": (q + 2 * kv, s.hidden_size),
        "o_proj": (s.hidden_size, q),
        "gate_up_proj": (2 * s.intermediate_size, s.hidden_size),
        "down_proj": (s.hidden_size, s.intermediate_size),
    }


def candidate_tiles(m: int, n: int, k: int) -> list[Tile]:
    default = tile_for(m, n, k, BLOCK[1])
    if m <= 16:
        others = [
            Tile(16, bn, split, 4, stages)
            for bn in (64, 128)
            for split in (1, 2, 4, 8, 16)
            for stages in (3, 4)
        ]
    elif m <= 256:
        others = [
            Tile(bm, bn, split, warps, stages, ahead=True)
            for bm in (32, 64, 128)
            for bn in (64, 128)
            for split in (1, 2, 4)
            for warps, stages in ((4, 3), (4, 4), (8, 3))
            if bm <= max(32, m)
        ]
        others.append(Tile(64, 128, 1, 4, 4))  # activations quantized in the loop
    else:
        others = [
            Tile(128, 128, 1, 8, 3, True),
            Tile(128, 128, 1, 8, 4, True),
            Tile(128, 64, 1, 4, 4, True),
            Tile(64, 128, 1, 4, 4, True),
            Tile(128, 256, 1, 8, 3, True),
            Tile(128, 128, 1, 8, 4),
        ]
    return [default] + [t for t in others if t != default]


def _cublas(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether cuBLAS's blockwise scaled matmul runs this product (not a single row's)."""
    if not cublas_blockwise(x.device, x.dtype):
        return False
    try:
        cublas_matmul(x, w, scale)
    except RuntimeError:
        return False
    return True


def graph_ms(call: Callable[..., object]) -> float:
    """GPU milliseconds per call(i), from a CUDA graph of COPIES x 4 calls: the weights (call i
    reads copy i % COPIES) do not stay in the L2 cache."""
    return device_graph_ms(call, COPIES * 4, warmup_calls=COPIES)


def sweep_fp8_gemm(shape: Qwen3Shape, batches: tuple[int, ...]) -> dict[str, Any]:
    rows = []
    for name, (n, k) in projections(shape).items():
        for row in _time_projection(n, k, batches):
            rows.append({"projection": name, **row})
            print(
                f"{name:13s} m={row['m']:5d} bf16 {row['bf16_ms']:.4f} "
                f"fp8 {row['fp8_default_ms']:.4f} ({row['fp8_over_bf16']:.2f}x) "
                f"best {row['fp8_best_ms']:.4f} {row['best_tile']} "
                f"cublas {row['cublas_blockwise_ms']} layer {row['fp8_linear_over_bf16']:.2f}x",
                flush=True,
            )
    return {"kind": "fp8-gemm", "block": list(BLOCK), "rows": rows}


def _time_projection(n: int, k: int, batches: tuple[int, ...]) -> list[dict[str, Any]]:
    device = torch.device("cuda")
    w8 = [random_fp8((n, k), device) for _ in range(COPIES)]
    scale = torch.full((n // BLOCK[0], k // BLOCK[1]), FP8_SCALE, device=device)
    w16 = [(w.float() * FP8_SCALE).to(torch.bfloat16) for w in w8]
    matmul = fp8_matmul()
    assert matmul is not None
    rows = []
    for m in batches:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        bf16_ms = graph_ms(lambda i, x=x: F.linear(x, w16[i % COPIES]))
        candidates = candidate_tiles(m, n, k)
        tiles = {
            str(tile): graph_ms(
                lambda i, x=x, tile=tile: fp8_block_matmul(x, w8[i % COPIES], scale, BLOCK, tile)
            )
            for tile in candidates
        }
        default = str(candidates[0])
        best = min(tiles, key=tiles.__getitem__)
        cublas = _cublas(x, w8[0], scale)
        cublas_ms = (
            graph_ms(lambda i, x=x: cublas_matmul(x, w8[i % COPIES], scale)) if cublas else None
        )
        layer_ms = graph_ms(lambda i, x=x: matmul(x, w8[i % COPIES], scale, BLOCK))
        rows.append(
            {
                "n": n,
                "k": k,
                "m": m,
                "bf16_ms": bf16_ms,
                "fp8_default_ms": tiles[default],
                "default_tile": default,
                "fp8_best_ms": tiles[best],
                "best_tile": best,
                "fp8_over_bf16": tiles[default] / bf16_ms,
                "cublas_blockwise_ms": cublas_ms,
                "fp8_linear_ms": layer_ms,  # the path Fp8Linear takes at this size
                "fp8_linear_over_bf16": layer_ms / bf16_ms,
                "tiles_ms": tiles,
            }
        )
    return rows

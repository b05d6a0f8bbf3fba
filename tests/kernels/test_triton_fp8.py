"""The block-scaled FP8 matmul (kernels/triton_fp8.py) against torch: in float32 against the
same arithmetic done by hand (activations quantized per row and block of columns, weights
dequantized per block); on the GPU in bfloat16 against the bf16 matmul of the dequantized
weight, within FP8's tolerance.

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from batchrun.attention.kv_dtype import FP8_MAX  # noqa: E402
from batchrun.kernels.triton_fp8 import Tile, fp8_block_matmul, quantize_groups  # noqa: E402
from batchrun.layers.fp8_linear import Fp8Linear  # noqa: E402
from tests.helpers.fp8_reference import quantize_blocks, quantized_activations  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Float32 sums in another order; on the GPU the fp8 tensor-core dot also accumulates with fewer
# bits than float32 (Hopper's, as DeepSeek-V3's report measures), hence its wider tolerance.
EXACT = 1e-4 if DEVICE.type == "cpu" else 2e-3


def fp8_layer(n: int, k: int, block: tuple[int, int], seed: int = 0) -> Fp8Linear:
    """An Fp8Linear holding a random weight quantized per block as Qwen's checkpoints are."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    layer = Fp8Linear(k, n, block)
    layer.weight.data, layer.weight_scale_inv.data = quantize_blocks(weight, block)
    return layer.to(DEVICE)


@pytest.mark.parametrize("block", [(128, 128), (32, 64)])
@pytest.mark.parametrize("m", [1, 5, 40, 130])
def test_the_kernel_is_the_quantized_arithmetic(m: int, block: tuple[int, int]) -> None:
    layer = fp8_layer(n=96, k=320, block=block)  # partial tiles in N and a partial last K block
    x = torch.randn(m, 320, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = fp8_block_matmul(x, layer.weight, layer.weight_scale_inv, block)
    expected = quantized_activations(x, block[1]) @ layer.dequantized().T
    torch.testing.assert_close(out, expected, atol=EXACT, rtol=EXACT)


@pytest.mark.parametrize(
    "tile",
    [
        Tile(16, 32, 3, 4, 2),
        Tile(16, 64, 8, 4, 2),
        Tile(32, 64, 1, 4, 2),
        Tile(16, 16, 2, 4, 2, ahead=True),
        Tile(32, 32, 1, 4, 2, ahead=True),
    ],
)
def test_split_k_sums_every_part_once(tile: Tile) -> None:
    layer = fp8_layer(n=80, k=640, block=(32, 64))  # 10 blocks of K over 1, 2, 4 or 8 programs
    x = torch.randn(40, 640, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    expected = quantized_activations(x, 64) @ layer.dequantized().T
    for _ in range(2):  # the last part of each tile leaves its counter zeroed for the next call
        out = fp8_block_matmul(x, layer.weight, layer.weight_scale_inv, (32, 64), tile)
        torch.testing.assert_close(out, expected, atol=EXACT, rtol=EXACT)


@pytest.mark.parametrize("m", [1, 33])  # programs of several rows: the last one part-filled
def test_quantize_groups_gives_the_fp8_values_and_their_scales(m: int) -> None:
    x = torch.randn(m, 320, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    padded_rows, padded_scales = quantize_groups(x, 128, rows=m + 3)  # cuBLAS's groups of 4
    assert not padded_rows[m:].float().any() and padded_scales.shape == (m + 3, 3)
    quantized, scales = quantize_groups(x, 128)
    assert torch.equal(padded_rows[:m].float(), quantized.float())
    assert torch.equal(padded_scales[:m], scales)
    assert quantized.dtype == torch.float8_e4m3fn and scales.shape == (m, 3)
    assert scales.stride() == (1, m)  # column by column, as cuBLAS reads them
    padded = F.pad(x, (0, 64)).reshape(m, 3, 128)
    expected_scales = padded.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    torch.testing.assert_close(scales, expected_scales, atol=0, rtol=0)
    full = expected_scales.repeat_interleave(128, 1)[:, :320]
    assert torch.equal(quantized.float(), (x / full).to(torch.float8_e4m3fn).float())


def test_on_the_cpu_the_layer_is_the_dequantized_matmul() -> None:
    layer = fp8_layer(n=48, k=64, block=(16, 16)).cpu()
    x = torch.randn(4, 2, 64)
    torch.testing.assert_close(layer(x), x @ layer.dequantized().T, atol=0, rtol=0)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bfloat16 tensor-core dot: the GPU's")
@pytest.mark.parametrize("m", [1, 16, 40, 128, 1000])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 12288)])  # Qwen3-8B's qkv, down
def test_bf16_is_the_dequantized_matmul_within_fp8_tolerance(m: int, n: int, k: int) -> None:
    layer = fp8_layer(n, k, (128, 128))
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    reference = x.float() @ layer.dequantized().T
    error = (out.float() - reference).norm() / reference.norm()
    assert error < 0.05, error  # e4m3 activations: about 2-3% relative error per element

"""The block convolution kernel (kernels/triton_block_conv.py) against the torch convolution it
replaces on CUDA (models/dflash2.py's block_conv_torch): float32 inputs to a float32 tolerance,
across block boundaries and row tiles, at several row counts, channel counts off the kernel's
tile, more taps than the loader's two, and the strided views BlockConv.prepare hands over.

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported) at tiny shapes. With CUDA, the cases marked `gpu` add the Qwen3-8B drafter's shape
(H 4096, group 16, block 16; 16 and 512 rows, bfloat16) and a CUDA graph replay."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from batchrun.kernels.triton_block_conv import block_conv_triton  # noqa: E402
from batchrun.models.dflash2 import CONV_TAPS, BlockConv, _kernel, block_conv_torch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FLOAT32 = {"rtol": 1e-6, "atol": 1e-6}  # the same products, summed in the same tap order


def conv_inputs(
    rows: int, hidden: int, group: int, taps: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen)
    dynamic = torch.randn(rows, taps, hidden // group, generator=gen)
    base = torch.randn(taps, hidden, generator=gen)
    return x.to(DEVICE, dtype), dynamic.to(DEVICE, dtype), base.to(DEVICE, dtype)


def block_conv_module(hidden: int, group: int, block: int, seed: int) -> BlockConv:
    torch.manual_seed(seed)
    conv = BlockConv(hidden, group, block)
    torch.nn.init.normal_(conv.base_kernel)
    torch.nn.init.normal_(conv.kernel_projection.weight, std=hidden**-0.5)
    return conv.to(DEVICE)


@pytest.mark.parametrize(
    ("rows", "hidden", "group", "block"),
    [
        (4, 8, 2, 4),  # one block, one tile
        (16, 32, 4, 16),  # one block filling a row tile
        (21, 24, 4, 3),  # blocks straddling the 16-row tiles, a partial last tile
        (48, 200, 8, 16),  # three tiles of rows, channels beyond one tile, a partial one
        (40, 130, 2, 8),
    ],
)
def test_the_kernel_convolves_as_the_torch_version(
    rows: int, hidden: int, group: int, block: int
) -> None:
    x, dynamic, base = conv_inputs(rows, hidden, group, CONV_TAPS, seed=rows + hidden)
    got = block_conv_triton(x, dynamic, base, block, group)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got, block_conv_torch(x, dynamic, base, block, group), **FLOAT32)


def test_the_first_row_of_each_block_reads_no_predecessor() -> None:
    """Only tap 0 reaches a block's first row: zero its kernel there and the row is zero."""
    rows, hidden, group, block = 24, 16, 4, 6
    x, dynamic, base = conv_inputs(rows, hidden, group, CONV_TAPS, seed=3)
    base[0] = 0
    dynamic[:, 0] = 0
    got = block_conv_triton(x, dynamic, base, block, group).view(rows // block, block, hidden)
    assert torch.equal(got[:, 0], torch.zeros_like(got[:, 0]))
    assert (got[:, 1:] != 0).any()


@pytest.mark.parametrize(("taps", "block"), [(1, 4), (3, 4), (4, 8)])
def test_the_kernel_takes_any_number_of_taps(taps: int, block: int) -> None:
    rows, hidden, group = 32, 48, 4
    x, dynamic, base = conv_inputs(rows, hidden, group, taps, seed=taps)
    got = block_conv_triton(x, dynamic, base, block, group)
    torch.testing.assert_close(got, block_conv_torch(x, dynamic, base, block, group), **FLOAT32)


def test_the_kernel_reads_the_views_prepare_hands_over() -> None:
    """Both sides' dynamic kernels as BlockConv slices them from one projection (strided, not
    copied), the base kernels as slices of the parameter."""
    rows, hidden, group, block = 32, 64, 8, 8
    conv = block_conv_module(hidden, group, block, seed=1)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        projected = conv.kernel_projection(x).view(rows, 2, CONV_TAPS, conv.groups)
        for side in range(2):
            dynamic, base = projected[:, side], conv.base_kernel[side]
            assert not dynamic.is_contiguous()
            got = block_conv_triton(x, dynamic, base, block, group)
            want = block_conv_torch(x, dynamic, base, block, group)
            torch.testing.assert_close(got, want, **FLOAT32)


def test_the_kernel_reads_strided_rows_and_channels() -> None:
    rows, hidden, group, block = 20, 40, 4, 5
    x, dynamic, base = conv_inputs(rows, hidden, group, CONV_TAPS, seed=7)
    wide_x = torch.cat([x, x], dim=1)[:, :hidden]  # rows 2H apart
    columns = base.t().contiguous().t()  # taps innermost
    spread = torch.stack([dynamic, dynamic], dim=-1)[..., 0]  # groups 2 apart
    assert not (wide_x.is_contiguous() or columns.is_contiguous() or spread.is_contiguous())
    got = block_conv_triton(wide_x, spread, columns, block, group)
    torch.testing.assert_close(got, block_conv_torch(x, dynamic, base, block, group), **FLOAT32)


def test_the_kernel_keeps_bfloat16_inputs_in_their_dtype() -> None:
    """bfloat16 in and out, float32 inside: the torch version on the float32 copies, rounded
    once to bfloat16."""
    rows, hidden, group, block = 16, 32, 4, 8
    x, dynamic, base = conv_inputs(rows, hidden, group, CONV_TAPS, seed=5, dtype=torch.bfloat16)
    got = block_conv_triton(x, dynamic, base, block, group)
    assert got.dtype == torch.bfloat16
    want = block_conv_torch(x.float(), dynamic.float(), base.float(), block, group)
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-5)


def test_no_rows_launch_nothing() -> None:
    x, dynamic, base = conv_inputs(0, 16, 4, CONV_TAPS, seed=0)
    assert block_conv_triton(x, dynamic, base, 4, 4).shape == (0, 16)


QWEN3_8B = {"hidden": 4096, "group": 16, "block": 16}


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [16, 512])
def test_the_qwen3_8b_drafter_shape_in_bfloat16(rows: int) -> None:
    hidden, group, block = QWEN3_8B["hidden"], QWEN3_8B["group"], QWEN3_8B["block"]
    conv = block_conv_module(hidden, group, block, seed=rows).bfloat16()
    x = torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        projected = conv.kernel_projection(x).view(rows, 2, CONV_TAPS, conv.groups)
        for side in range(2):
            dynamic, base = projected[:, side], conv.base_kernel[side]
            got = block_conv_triton(x, dynamic, base, block, group)
            want = block_conv_torch(x.float(), dynamic.float(), base.float(), block, group)
            torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-4)


@pytest.mark.gpu
def test_block_conv_takes_the_kernel_on_cuda_and_replays_in_a_cuda_graph() -> None:
    """prepare and finish, captured at the Qwen3-8B drafter's shape (512 rows), replayed on new
    inputs: the torch version's results on those inputs, in float32."""
    rows, hidden, group, block = 512, QWEN3_8B["hidden"], QWEN3_8B["group"], QWEN3_8B["block"]
    conv = block_conv_module(hidden, group, block, seed=0).bfloat16()
    static_x = torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16)
    static_y = torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16)

    assert _kernel(static_x) is block_conv_triton

    def step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, dynamic = conv.prepare(static_x)
        return h, conv.finish(static_y, dynamic), dynamic

    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            h, out, dynamic = step()
        static_x.copy_(torch.randn_like(static_x))
        static_y.copy_(torch.randn_like(static_y))
        graph.replay()
        torch.cuda.synchronize()
        base = conv.base_kernel.float()
        projected = conv.kernel_projection(static_x).float().view(rows, 2, CONV_TAPS, -1)
        want_h = block_conv_torch(static_x.float(), projected[:, 0], base[0], block, group)
        want_out = block_conv_torch(static_y.float(), projected[:, 1], base[1], block, group)
    torch.testing.assert_close(dynamic.float(), projected[:, 1])
    torch.testing.assert_close(h.float(), want_h, rtol=2**-7, atol=1e-4)
    torch.testing.assert_close(out.float(), want_out, rtol=2**-7, atol=1e-4)

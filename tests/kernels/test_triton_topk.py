"""The vocabulary top-K kernel (kernels/triton_topk.py) against torch.topk, the reference it
replaces on CUDA (layers/top_k.py): the same values, exactly, descending; indices that point at
those values, each once, equal values in ascending index order; the dispatch; a CUDA graph replay.

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported) at small shapes, with small chunks so that a row spans several stage-1 programs and its
last chunk is partial. No arithmetic touches a value, so the values compare exactly on any CPU.
With CUDA, the cases marked `gpu` add DFlash2's shapes (V 151936 bf16, N 16 and 480)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from batchrun.kernels import compile_check  # noqa: E402
from batchrun.kernels.triton_topk import MAX_K, supports_k, topk_triton  # noqa: E402
from batchrun.layers import top_k as top_k_module  # noqa: E402
from batchrun.layers.top_k import top_k  # noqa: E402
from tests.helpers.sm90 import compile_offline  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def logits(n: int, v: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=gen) * 4).to(dtype).to(DEVICE)


def assert_topk(x: torch.Tensor, k: int, got: tuple[torch.Tensor, torch.Tensor]) -> None:
    """got is x's top k: torch.topk's values, and indices that each name one of them."""
    values, indices = got
    want = x.topk(k, dim=-1).values
    assert values.dtype == x.dtype and indices.dtype == torch.int64
    assert values.shape == indices.shape == want.shape
    assert torch.equal(values, want)
    assert torch.equal(x.gather(-1, indices), values)
    assert torch.all(indices.sort(dim=-1).values.diff(dim=-1) > 0)  # each element once


def assert_ties_ascending(values: torch.Tensor, indices: torch.Tensor) -> None:
    same = values[..., 1:] == values[..., :-1]
    assert torch.all(~same | (indices[..., 1:] > indices[..., :-1]))


@pytest.mark.parametrize(
    ("n", "v", "k", "chunk"),
    [
        (3, 600, 16, 256),  # three chunks, the last 88 elements
        (4, 1000, 1, 64),
        (2, 1000, 4, 256),  # 16 groups a chunk, 4 kept: the group pruning at work
        (3, 37, 16, 16),  # V a prime, barely above K: one chunk, mostly masked
        (2, 16, 16, 4096),  # V == K
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_keeps_torch_topks_values(
    n: int, v: int, k: int, chunk: int, dtype: torch.dtype
) -> None:
    x = logits(n, v, seed=v + k, dtype=dtype)
    assert_topk(x, k, topk_triton(x, k, chunk=chunk))


@pytest.mark.parametrize("k", [1, 16])
def test_repeated_values_rank_the_lower_index_first(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    x = torch.randint(0, 3, (4, 500), generator=gen).float().to(DEVICE)  # ~170 ties per value
    x[1, 300:] = 5.0  # the top K all equal, past the first chunk
    got = topk_triton(x, k, chunk=256)
    assert_topk(x, k, got)
    assert_ties_ascending(*got)
    assert torch.equal(got[1][1], torch.arange(300, 300 + k, device=DEVICE))


def test_minus_infinity_ranks_below_every_finite_value() -> None:
    x = torch.full((3, 600), float("-inf"), device=DEVICE)
    x[0, [5, 270, 599]] = torch.tensor([1.0, -3.0, 2.0], device=DEVICE)  # three finite, K 16
    x[1] = logits(1, 600, seed=3)[0]
    x[1, ::2] = float("-inf")
    values, indices = topk_triton(x, 16, chunk=256)  # row 2: all -inf
    assert_topk(x, 16, (values, indices))
    assert torch.equal(indices[0, :3], torch.tensor([599, 5, 270], device=DEVICE))
    assert_ties_ascending(values, indices)


def test_signed_zeros_tie_and_nan_ranks_first_as_in_torch() -> None:
    x = torch.full((2, 150), -1.0, device=DEVICE)
    x[0, [3, 70, 130]] = torch.tensor([-0.0, 0.0, -0.0], device=DEVICE)
    x[1, 121] = float("nan")
    values, indices = topk_triton(x, 4, chunk=64)
    assert torch.equal(indices[0, :3], torch.tensor([3, 70, 130], device=DEVICE))
    assert torch.equal(values[0], torch.tensor([0.0, 0.0, 0.0, -1.0], device=DEVICE))
    assert indices[1, 0] == 121 and values[1, 0].isnan()
    torch.testing.assert_close(values, x.topk(4).values, equal_nan=True, atol=0, rtol=0)


def test_the_kernel_keeps_leading_dimensions_and_reads_strided_rows() -> None:
    wide = logits(6, 150, seed=7)
    x = wide[:, :130].reshape(2, 3, 130)  # [R, B-1, V], rows 150 apart
    assert not x.is_contiguous()
    values, indices = topk_triton(x, 8, chunk=128)
    assert values.shape == (2, 3, 8)
    assert_topk(x, 8, (values, indices))


def test_no_rows_give_empty_results() -> None:
    values, indices = topk_triton(torch.empty(0, 50, device=DEVICE), 4)
    assert values.shape == indices.shape == (0, 4)


@pytest.mark.parametrize(("k", "v"), [(3, 100), (0, 100), (2 * MAX_K, 1000), (8, 5)])
def test_the_kernel_refuses_what_it_does_not_compute(k: int, v: int) -> None:
    with pytest.raises(ValueError, match="top-K kernel"):
        topk_triton(torch.zeros(2, v, device=DEVICE), k)


def test_supports_k_names_the_powers_of_two_up_to_max_k() -> None:
    assert [k for k in range(2 * MAX_K) if supports_k(k)] == [1, 2, 4, 8, 16, 32, 64]


def test_top_k_on_the_cpu_is_torch_topk() -> None:
    x = logits(3, 90, seed=1).cpu()
    want = x.topk(5, dim=-1)
    values, indices = top_k(x, 5)
    assert torch.equal(values, want.values) and torch.equal(indices, want.indices)


@pytest.mark.skipif(not compile_check.available(), reason="Triton's NVIDIA tools are missing")
def test_the_kernel_compiles_for_sm90_without_spills() -> None:
    """DFlash2's case (bf16, K 16, V 151936) compiles for Hopper ahead of time, no GPU needed;
    `python -m batchrun.kernels.compile_check --top-k` checks every K and dtype."""
    run = compile_offline("-m", "batchrun.kernels.compile_check", "--top-k", "--quick")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok top-K") == 2, run.stdout


@pytest.mark.gpu
def test_top_k_takes_the_kernel_on_cuda_for_the_k_it_supports() -> None:
    x = logits(4, 1000, seed=2)
    assert top_k_module._kernel(x, 16) is topk_triton
    assert top_k_module._kernel(x, 12) is None  # torch.topk: not a power of two
    assert_topk(x, 16, top_k(x, 16))
    assert_topk(x, 12, top_k(x, 12))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [16, 480])
@pytest.mark.parametrize("k", [16, 64])
def test_dflash2s_shape(n: int, k: int) -> None:
    """[N, 151936] bf16: the draft head's rows at batch 1 and 32 (15 draft positions each)."""
    x = logits(n, 151_936, seed=n + k, dtype=torch.bfloat16)
    got = topk_triton(x, k)
    assert_topk(x, k, got)
    assert_ties_ascending(*got)


@pytest.mark.gpu
def test_float32_at_a_large_vocabulary() -> None:
    x = logits(8, 262_145, seed=5)
    assert_topk(x, 16, topk_triton(x, 16))


@pytest.mark.gpu
def test_the_kernel_replays_in_a_cuda_graph() -> None:
    static = logits(480, 151_936, seed=8, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            topk_triton(static, 16)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = topk_triton(static, 16)
    fresh = logits(480, 151_936, seed=9, dtype=torch.bfloat16)
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert_topk(fresh, 16, out)

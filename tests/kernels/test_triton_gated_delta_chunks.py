"""The Gated DeltaNet prefill-chunk kernels (kernels/triton_gated_delta_chunks.py) against the
torch form they replace (layers/gated_delta.py's prefill_chunks: causal_conv and chunked_rule a
chunk at a time): outputs and the slots' states after a step of chunks of random lengths, 1 and
past a 64-row chunk among them, from zero (fresh) and carried states, in scattered slots, two v
heads per q/k head.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1) at tiny shapes in
float32; with CUDA on the GPU, where the case marked `gpu` adds a real layer's shape."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from batchrun.kernels import triton_gated_delta_chunks as kernels  # noqa: E402
from batchrun.layers import gated_delta  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TINY = dict(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=16, kernel=4)
# Qwen3.5's linear layers: 16 q/k heads of 128, 32 v heads of 128, a conv of 4 taps.
REAL = dict(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, kernel=4)


def check(shape: dict[str, int], lens: tuple[int, ...], fresh: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(sum(lens) + fresh)
    hk, hv, dk, dv = (shape[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"))
    channels, n, num_slots = 2 * hk * dk + hv * dv, sum(lens), 2 * len(lens) + 1
    scale = 0.0 if fresh else 1.0  # a fresh request's slot is zeroed by the layer
    x = {
        "qkv": torch.randn(n, channels, generator=gen).to(dtype),
        "g": -torch.rand(n, hv, generator=gen),
        "beta": torch.rand(n, hv, generator=gen),
        "conv": (torch.randn(num_slots, channels, shape["kernel"] - 1, generator=gen) * scale),
        "recurrent": torch.randn(num_slots, hv, dk, dv, generator=gen) * 0.3 * scale,
        "weight": (torch.randn(channels, shape["kernel"], generator=gen) * 0.5).to(dtype),
        "slots": torch.randperm(num_slots, generator=gen)[: len(lens)],
    }
    x = {k: v.to(DEVICE) for k, v in x.items()}
    x["conv"] = x["conv"].to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    conv, recurrent = x["conv"].clone(), x["recurrent"].clone()
    want = gated_delta.prefill_chunks(
        x["qkv"], x["g"], x["beta"], conv, recurrent, x["slots"], lens, x["weight"], hk, dk
    )
    got_conv, got_recurrent = x["conv"].clone(), x["recurrent"].clone()
    mixed = kernels.conv_chunks(x["qkv"], got_conv, x["slots"], cu.to(DEVICE), x["weight"])
    got = kernels.delta_chunks(
        mixed, x["g"], x["beta"], got_recurrent, x["slots"], cu.to(DEVICE), hk, dk
    )
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(got_conv.float(), conv.float(), **tol)
    torch.testing.assert_close(got_recurrent, recurrent, **tol)


@pytest.mark.parametrize("fresh", [True, False])
@pytest.mark.parametrize("lens", [(1,), (3, 70, 1, 2), (17, 5)])
def test_chunks_match_the_chunked_rule(lens: tuple[int, ...], fresh: bool) -> None:
    check(TINY, lens, fresh, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_match_the_chunked_rule_at_a_real_shape(dtype: torch.dtype) -> None:
    check(REAL, (1, 300, 37, 130), False, dtype)

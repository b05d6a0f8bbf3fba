"""The Gated DeltaNet decode-row kernels (kernels/triton_gated_delta.py) against the torch
functions they replace (layers/gated_delta.py's conv_rows and delta_rows): outputs and the
slots' states after a verify (read only), a decode step (every row kept) and a commit (each
request's accepted rows), requests in scattered slots, two v heads per q/k head.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported) at tiny shapes; with CUDA on the GPU, where the cases marked `gpu` add a real layer's
shapes in bfloat16."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from batchrun.kernels import triton_gated_delta as kernels  # noqa: E402
from batchrun.layers import gated_delta  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TINY = dict(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=16, kernel=4)
# Qwen3.5's linear layers: 16 q/k heads of 128, 32 v heads of 128, a conv of 4 taps.
REAL = dict(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, kernel=4)


def inputs(
    shape: dict[str, int], requests: int, width: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """A step's rows and slot states: `requests` requests in scattered slots of 2x as many."""
    gen = torch.Generator().manual_seed(requests * 31 + width)
    hk, hv, dk, dv = (shape[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"))
    channels = 2 * hk * dk + hv * dv
    num_slots = 2 * requests + 1

    def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(size, generator=gen) * scale

    made = {
        "qkv": rand(requests, width, channels).to(dtype),
        "conv": rand(num_slots, channels, shape["kernel"] - 1).to(dtype),
        "weight": rand(channels, shape["kernel"], scale=0.5).to(dtype),
        "g": -torch.rand(requests, width, hv, generator=gen),
        "beta": torch.rand(requests, width, hv, generator=gen),
        "recurrent": rand(num_slots, hv, dk, dv, scale=0.3),
        "slots": torch.randperm(num_slots, generator=gen)[:requests],
    }
    return {k: v.to(DEVICE) for k, v in made.items()}


def run(
    impl: object,
    x: dict[str, torch.Tensor],
    keep: torch.Tensor | None,
    shape: dict[str, int],
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(outputs, conv states, recurrent states) of impl's conv_rows then delta_rows, on copies
    (`rows`, each request's own, goes to the kernels: the reference computes every cell)."""
    conv, recurrent = x["conv"].clone(), x["recurrent"].clone()
    bound = {"rows": rows} if rows is not None else {}
    mixed = impl.conv_rows(x["qkv"], conv, x["slots"], x["weight"], keep, **bound)  # type: ignore[attr-defined]
    out = impl.delta_rows(  # type: ignore[attr-defined]
        mixed,
        x["g"],
        x["beta"],
        recurrent,
        x["slots"],
        keep,
        shape["num_k_heads"],
        shape["head_k_dim"],
        **bound,
    )
    return out, conv, recurrent


def check(shape: dict[str, int], requests: int, width: int, dtype: torch.dtype, mode: str) -> None:
    x = inputs(shape, requests, width, dtype)
    keep = own = None
    if mode == "decode":
        keep = torch.full((requests,), width, device=DEVICE)
    elif mode == "commit":  # accepted + 1 rows: from 1 (no draft accepted) to every row
        keep = own = torch.arange(requests, device=DEVICE) % width + 1
    elif mode == "ragged verify":  # rows of 1 to width in a width-wide grid, as in a graph
        own = torch.arange(requests, device=DEVICE) % width + 1
    want_out, want_conv, want_state = run(gated_delta, x, keep, shape)
    out, conv, state = run(kernels, x, keep, shape, own)
    # Where a slot is written: only the step's; where its rows' outputs hold: rows 0..keep-1.
    kept = keep if keep is not None else own
    if kept is None:
        kept = torch.full((requests,), width, device=DEVICE)
    rows = torch.arange(width, device=DEVICE)[None] < kept[:, None]
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype != torch.float32 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(out[rows].float(), want_out[rows].float(), **tol)
    torch.testing.assert_close(conv, want_conv, atol=0, rtol=0)  # inputs moved, never computed
    torch.testing.assert_close(state, want_state, **tol)
    if keep is None:  # a verify step reads its slots and writes nothing there
        assert torch.equal(conv, x["conv"]) and torch.equal(state, x["recurrent"])
    else:
        assert not torch.equal(state, x["recurrent"]), "the step's slots were written"


@pytest.mark.parametrize("mode", ["verify", "ragged verify", "decode", "commit"])
@pytest.mark.parametrize("width", [1, 3, 5])
def test_the_kernels_are_the_torch_rows(mode: str, width: int) -> None:
    if "verify" in mode and width == 1:
        pytest.skip("width 1 never verifies")
    check(TINY, 3, width, torch.float32, mode)


def test_a_kernel_of_no_requests_launches_nothing() -> None:
    x = inputs(TINY, 1, 2, torch.float32)
    empty = {k: v[:0] if k in ("qkv", "g", "beta", "slots") else v for k, v in x.items()}
    out, conv, state = run(kernels, empty, None, TINY)
    assert out.shape == (0, 2, TINY["num_v_heads"], TINY["head_v_dim"])
    assert torch.equal(conv, x["conv"]) and torch.equal(state, x["recurrent"])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["verify", "ragged verify", "decode", "commit"])
@pytest.mark.parametrize("width", [1, 16])
def test_the_kernels_are_the_torch_rows_at_real_shapes(mode: str, width: int) -> None:
    if "verify" in mode and width == 1:
        pytest.skip("width 1 never verifies")
    check(REAL, 48, width, torch.bfloat16, mode)

"""The Gated DeltaNet decode-row kernels (kernels/triton_gated_delta.py, behind TritonOps) against
the torch reference (TorchOps: layers/gated_delta.py's functions over a padded grid): outputs
and the slots' states after a verify (read only), a decode step (each row kept) and a commit
(each request's accepted rows). Rows are packed as a step packs them: requests of their own
widths, in scattered slots, two v heads per q/k head, and requests padding a CUDA graph (no
rows, the scratch slot) after them, whose rows past the live ones stay zero.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported) at tiny shapes; with CUDA on the GPU, where the cases marked `gpu` add a real layer's
shapes in bfloat16."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from batchrun.attention.meta import row_starts  # noqa: E402
from batchrun.layers.ops import DecodeRows, TorchOps  # noqa: E402
from batchrun.layers.triton_ops import TritonOps  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TINY = dict(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=16, kernel=4)
# Qwen3.5's linear layers: 16 q/k heads of 128, 32 v heads of 128, a conv of 4 taps.
REAL = dict(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, kernel=4)
PADDING = 2  # requests padding the step, as in a graph: no rows, the scratch slot


def step(
    shape: dict[str, int], lens: list[int], width: int, dtype: torch.dtype, reverse: bool = False
) -> tuple[dict[str, torch.Tensor], DecodeRows]:
    """A step's packed rows (each request's lens[r], then as many padding rows as a graph of
    `width` per request would hold) and slot states, live requests in scattered slots."""
    requests = len(lens)
    gen = torch.Generator().manual_seed(requests * 31 + width + sum(lens))
    hk, hv, dk, dv = (shape[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"))
    channels = 2 * hk * dk + hv * dv
    num_slots = 2 * requests + 1
    rows = (requests + PADDING) * width

    def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(size, generator=gen) * scale

    scratch = torch.tensor([num_slots - 1] * PADDING)
    made = {
        "qkv": rand(rows, channels).to(dtype),
        "conv": rand(num_slots, channels, shape["kernel"] - 1).to(dtype),
        "weight": rand(channels, shape["kernel"], scale=0.5).to(dtype),
        "g": -torch.rand(rows, hv, generator=gen),
        "beta": torch.rand(rows, hv, generator=gen),
        "recurrent": rand(num_slots, hv, dk, dv, scale=0.3),
        "slots": torch.cat([torch.randperm(num_slots - 1, generator=gen)[:requests], scratch]),
    }
    x = {k: v.to(DEVICE) for k, v in made.items()}
    q_lens = torch.tensor(lens + [0] * PADDING, device=DEVICE)
    starts = row_starts(q_lens)
    if reverse:  # the live requests' rows in reverse order: a request that ran past its rows
        # would write over the rows of one whose program ran before it (as Triton's
        # interpreter runs programs in order)
        live = torch.tensor(lens[::-1], device=DEVICE)
        starts[:requests] = row_starts(live).flip(0)
    return x, DecodeRows(starts, q_lens, width)


def run(
    ops: TorchOps, x: dict[str, torch.Tensor], rows: DecodeRows, keep: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(outputs, conv states, recurrent states) of ops' conv_rows then delta_rows, on copies."""
    conv, recurrent = x["conv"].clone(), x["recurrent"].clone()
    shape = (x["qkv"].shape[0], x["recurrent"].shape[1], x["recurrent"].shape[3])
    out = torch.zeros(shape, dtype=x["qkv"].dtype, device=DEVICE)
    mixed = ops.conv_rows(x["qkv"], conv, x["slots"], rows, x["weight"], keep)
    heads, dk = x["recurrent"].shape[1:3]
    k_heads = TINY["num_k_heads"] if heads == TINY["num_v_heads"] else REAL["num_k_heads"]
    ops.delta_rows(mixed, x["g"], x["beta"], recurrent, x["slots"], rows, keep, k_heads, dk, out)
    return out, conv, recurrent


def check(
    shape: dict[str, int], lens: list[int], width: int, dtype: torch.dtype, mode: str
) -> None:
    x, rows = step(shape, lens, width, dtype, reverse="reversed" in mode)
    keep = None
    if mode == "decode":  # each live request keeps its one row, a padding request none
        keep = rows.lens
    elif mode.startswith("commit"):  # accepted + 1 rows: from 1 (no draft accepted) to every row
        keep = torch.tensor([i % n + 1 for i, n in enumerate(lens)] + [0] * PADDING, device=DEVICE)
        rows = DecodeRows(rows.starts, keep, width)
    want_out, want_conv, want_state = run(TorchOps(), x, rows, keep)
    out, conv, state = run(TritonOps(), x, rows, keep)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype != torch.float32 else {"atol": 1e-4, "rtol": 1e-4}
    # Each request's outputs at its rows (its kept ones), zeros elsewhere; the slots' states.
    torch.testing.assert_close(out.float(), want_out.float(), **tol)
    torch.testing.assert_close(conv, want_conv, atol=0, rtol=0)  # inputs moved, never computed
    torch.testing.assert_close(state, want_state, **tol)
    owned = torch.zeros(out.shape[0], dtype=torch.bool, device=DEVICE)
    for start, n in zip(rows.starts.tolist(), rows.lens.tolist(), strict=True):
        owned[start : start + n] = True
    assert not out[~owned].any(), "rows no request runs stay as they were"
    assert out[owned].abs().sum((-2, -1)).gt(0).all(), "every row a request runs has its output"
    if keep is None:  # a verify step reads its slots and writes nothing there
        assert torch.equal(conv, x["conv"]) and torch.equal(state, x["recurrent"])
    else:
        assert not torch.equal(state, x["recurrent"]), "the step's slots were written"


@pytest.mark.parametrize(
    "mode, lens, width",
    [
        ("decode", [1, 1, 1], 1),
        ("verify", [3, 3, 3], 3),
        ("verify", [1, 3, 5], 5),  # rows of their own widths, as a graph as wide as 5 runs them
        ("verify", [2, 1], 16),
        ("verify reversed", [1, 3, 5], 5),
        ("commit", [3, 3, 3], 3),
        ("commit", [5, 2, 4], 5),
        ("commit reversed", [5, 2, 4], 5),
    ],
)
def test_the_kernels_are_the_torch_rows(mode: str, lens: list[int], width: int) -> None:
    check(TINY, lens, width, torch.float32, mode)


def test_a_kernel_of_no_requests_launches_nothing() -> None:
    x, rows = step(TINY, [2], 2, torch.float32)
    empty = {k: v[:0] if k == "slots" else v for k, v in x.items()}
    none = DecodeRows(rows.starts[:0], rows.lens[:0], 2)
    out, conv, state = run(TritonOps(), empty, none, None)
    assert not out.any()
    assert torch.equal(conv, x["conv"]) and torch.equal(state, x["recurrent"])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["verify", "decode", "commit"])
@pytest.mark.parametrize("width", [1, 16])
def test_the_kernels_are_the_torch_rows_at_real_shapes(mode: str, width: int) -> None:
    if mode != "decode" and width == 1:
        pytest.skip("width 1 never verifies")
    if mode == "decode" and width > 1:
        pytest.skip("a decode step has one row a request")
    lens = [width] * 24 + [max(width // 3, 1)] * 24
    check(REAL, lens, width, torch.bfloat16, mode)

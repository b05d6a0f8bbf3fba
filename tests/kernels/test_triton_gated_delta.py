"""The Gated DeltaNet decode-row kernels (kernels/triton_gated_delta.py, behind TritonOps) against
the torch reference (TorchOps: layers/gated_delta.py's functions over a padded grid): outputs,
the slots' states and the rows a verify stages after a verify (each slot first takes the rows
its last verify kept) and a decode step (those and its row), and the conv's carried inputs
after a commit (each request's accepted rows). Rows are packed as a step packs them: requests
of their own widths, in scattered slots, two v heads per q/k head, and requests padding a CUDA
graph (no rows, the scratch slot) after them, whose rows past the live ones stay zero.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported) at tiny shapes; with CUDA on the GPU, where the cases marked `gpu` add a real layer's
shapes in bfloat16."""

from __future__ import annotations

import os
from dataclasses import fields

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from batchrun.attention.meta import row_starts  # noqa: E402
from batchrun.layers.ops import DecodeRows, KeptRows, TorchOps  # noqa: E402
from batchrun.layers.triton_ops import TritonOps  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TINY = dict(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=16, kernel=4)
# Qwen3.5's linear layers: 16 q/k heads of 128, 32 v heads of 128, a conv of 4 taps.
REAL = dict(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, kernel=4)
PADDING = 2  # requests padding the step, as in a graph: no rows, the scratch slot


def step(
    shape: dict[str, int], lens: list[int], width: int, dtype: torch.dtype, reverse: bool = False
) -> tuple[dict[str, torch.Tensor], DecodeRows, KeptRows]:
    """A step's packed rows (each request's lens[r], then as many padding rows as a graph of
    `width` per request would hold) and slot states, live requests in scattered slots, each
    with rows its last verify kept pending (0 to `width` of them, in either buffer)."""
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
    count = torch.randint(0, width + 1, (num_slots,), generator=gen, dtype=torch.int32)
    count[-1] = 0  # the scratch slot's (no commit hands it rows)
    staged = (num_slots, 2, width)
    kept = KeptRows(
        count.to(DEVICE),
        torch.randint(0, 2, (num_slots,), generator=gen, dtype=torch.int32).to(DEVICE),
        kv=rand(*staged, channels - hk * dk).to(dtype).to(DEVICE),
        g=-torch.rand(*staged, hv, generator=gen).to(DEVICE),
        beta=torch.rand(*staged, hv, generator=gen).to(DEVICE),
    )
    return x, DecodeRows(starts, q_lens, width), kept


def run(
    ops: TorchOps,
    x: dict[str, torch.Tensor],
    rows: DecodeRows,
    kept: KeptRows,
    keep: torch.Tensor | None,
    update: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, KeptRows]:
    """(outputs, conv states, recurrent states, kept rows) of ops' conv_rows then delta_rows,
    on copies."""
    conv, recurrent = x["conv"].clone(), x["recurrent"].clone()
    kept = KeptRows(*(getattr(kept, f.name).clone() for f in fields(kept)))
    shape = (x["qkv"].shape[0], x["recurrent"].shape[1], x["recurrent"].shape[3])
    out = torch.zeros(shape, dtype=x["qkv"].dtype, device=DEVICE)
    mixed = ops.conv_rows(x["qkv"], conv, x["slots"], rows, x["weight"], keep)
    heads, dk = x["recurrent"].shape[1:3]
    k_heads = TINY["num_k_heads"] if heads == TINY["num_v_heads"] else REAL["num_k_heads"]
    ops.delta_rows(
        mixed, x["g"], x["beta"], recurrent, x["slots"], rows, kept, update, k_heads, dk, out
    )
    return out, conv, recurrent, kept


def check(
    shape: dict[str, int], lens: list[int], width: int, dtype: torch.dtype, mode: str
) -> None:
    x, rows, kept = step(shape, lens, width, dtype, reverse="reversed" in mode)
    update = mode == "decode"  # each live request keeps its one row, a padding request none
    keep = rows.lens if update else None
    want_out, want_conv, want_state, want_kept = run(TorchOps(), x, rows, kept, keep, update)
    out, conv, state, got_kept = run(TritonOps(), x, rows, kept, keep, update)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype != torch.float32 else {"atol": 1e-4, "rtol": 1e-4}
    # Each request's outputs at its rows, zeros elsewhere; the slots' states.
    torch.testing.assert_close(out.float(), want_out.float(), **tol)
    torch.testing.assert_close(conv, want_conv, atol=0, rtol=0)  # inputs moved, never computed
    torch.testing.assert_close(state, want_state, **tol)
    owned = torch.zeros(out.shape[0], dtype=torch.bool, device=DEVICE)
    for start, n in zip(rows.starts.tolist(), rows.lens.tolist(), strict=True):
        owned[start : start + n] = True
    assert not out[~owned].any(), "rows no request runs stay as they were"
    assert out[owned].abs().sum((-2, -1)).gt(0).all(), "every row a request runs has its output"
    live = x["slots"][: len(lens)]
    pending = kept.count[live] > 0
    taken = (state[live] != x["recurrent"][live]).flatten(1).any(1)
    if update:  # the slots took their pending rows and their row
        assert taken.all()
    else:  # a verify step's slots took their pending rows only: their own are staged
        assert torch.equal(taken, pending), "a slot's state is written iff it had rows pending"
        assert torch.equal(conv, x["conv"]), "a verify reads the carried inputs"
        for r, (slot, n) in enumerate(zip(live.tolist(), lens, strict=True)):
            other = 1 - int(kept.buffer[slot])
            first = int(rows.starts[r])
            staged = (slot, other, slice(0, n))
            torch.testing.assert_close(got_kept.kv[staged], want_kept.kv[staged], **tol)
            assert torch.equal(got_kept.g[staged], x["g"][first : first + n])  # copies
            assert torch.equal(got_kept.beta[staged], x["beta"][first : first + n])
    # The buffers the pending rows are in are only read.
    for name in ("kv", "g", "beta"):
        for slot in live.tolist():
            b = int(kept.buffer[slot])
            assert torch.equal(getattr(got_kept, name)[slot, b], getattr(kept, name)[slot, b])
    assert torch.equal(got_kept.count, kept.count) and torch.equal(got_kept.buffer, kept.buffer)


def check_conv_commit(lens: list[int], width: int, reverse: bool) -> None:
    """A verify's commit (accepted + 1 rows of each request, from 1 to all): the conv's carried
    inputs after them."""
    x, rows, _ = step(TINY, lens, width, torch.float32, reverse=reverse)
    keep = torch.tensor([i % n + 1 for i, n in enumerate(lens)] + [0] * PADDING, device=DEVICE)
    rows = DecodeRows(rows.starts, keep, width)
    convs = []
    for ops in (TorchOps(), TritonOps()):
        conv = x["conv"].clone()
        ops.conv_rows(x["qkv"], conv, x["slots"], rows, x["weight"], keep)
        convs.append(conv)
    torch.testing.assert_close(convs[1], convs[0], atol=0, rtol=0)
    assert not torch.equal(convs[1], x["conv"])


@pytest.mark.parametrize(
    "mode, lens, width",
    [
        ("decode", [1, 1, 1], 1),
        ("decode", [1, 1, 1], 4),  # a decode step after verifies of 4 rows: up to 4 pending
        ("verify", [3, 3, 3], 3),
        ("verify", [1, 3, 5], 5),  # rows of their own widths, as a graph as wide as 5 runs them
        ("verify", [2, 1], 16),
        ("verify reversed", [1, 3, 5], 5),
    ],
)
def test_the_kernels_are_the_torch_rows(mode: str, lens: list[int], width: int) -> None:
    check(TINY, lens, width, torch.float32, mode)


@pytest.mark.parametrize("lens, width, reverse", [([3, 3, 3], 3, False), ([5, 2, 4], 5, True)])
def test_the_conv_commit_is_the_torch_one(lens: list[int], width: int, reverse: bool) -> None:
    check_conv_commit(lens, width, reverse)


def test_a_kernel_of_no_requests_launches_nothing() -> None:
    x, rows, kept = step(TINY, [2], 2, torch.float32)
    empty = {k: v[:0] if k == "slots" else v for k, v in x.items()}
    none = DecodeRows(rows.starts[:0], rows.lens[:0], 2)
    out, conv, state, _ = run(TritonOps(), empty, none, kept, None, False)
    assert not out.any()
    assert torch.equal(conv, x["conv"]) and torch.equal(state, x["recurrent"])


@pytest.mark.gpu
@pytest.mark.parametrize("mode, width", [("verify", 16), ("decode", 1), ("decode", 16)])
def test_the_kernels_are_the_torch_rows_at_real_shapes(mode: str, width: int) -> None:
    lens = [1] * 48 if mode == "decode" else [width] * 24 + [max(width // 3, 1)] * 24
    check(REAL, lens, width, torch.bfloat16, mode)

"""The fused experts (kernels/triton_moe.py) against the MoE block's reference path.

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported) in float32; with CUDA on the GPU in float32 and bfloat16."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from batchrun.kernels.triton_moe import align, fused_experts  # noqa: E402
from batchrun.layers.moe import SparseMoe  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def moe_block(hidden: int, intermediate: int, experts: int, top_k: int, dtype: torch.dtype):
    torch.manual_seed(0)
    block = SparseMoe(hidden, intermediate, experts, top_k, norm_topk=True)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.2)
    block = block.to(DEVICE, dtype)
    block.pack()
    return block


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 70])
def test_fused_experts_are_the_reference(tokens: int, dtype: torch.dtype) -> None:
    block = moe_block(hidden=96, intermediate=80, experts=8, top_k=3, dtype=dtype)
    x = torch.randn(tokens, 96, device=DEVICE, dtype=dtype)
    experts, weights = block.route(x)
    assert block.w13 is not None and block.w2 is not None
    silu_mul = block.swiglus[0].ops.silu_mul
    fused = fused_experts(x, block.w13, block.w2, experts, weights, silu_mul)
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():  # the reference, by hand (forward takes the fused path)
        token, slot = (experts == e).nonzero(as_tuple=True)
        out.index_add_(0, token, block.swiglus[e](x[token]) * weights[token, slot, None])
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fused, out, atol=tolerance, rtol=tolerance)


def test_align_puts_every_pair_once_in_blocks_of_one_expert() -> None:
    torch.manual_seed(1)
    experts = torch.randint(0, 5, (37,), device=DEVICE)
    experts[:4] = 2  # an expert with many pairs, and (likely) one with none
    sorted_ids, block_expert, total = align(experts, num_experts=6, block_m=4)
    used = sorted_ids[: int(total)]
    real = used[used < 37]
    assert sorted(real.tolist()) == list(range(37))
    blocks = used.view(-1, 4)
    for b, row in enumerate(blocks.tolist()):
        chosen = {int(experts[i]) for i in row if i < 37}
        assert chosen <= {int(block_expert[b])} and chosen  # no block is all padding
    assert (sorted_ids[int(total) :] == 37).all()

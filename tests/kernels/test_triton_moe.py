"""The fused experts (kernels/triton_moe.py) against the MoE block's reference path.

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported) in float32; with CUDA on the GPU in float32 and bfloat16."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from batchrun.kernels.triton_moe import align, fused_experts  # noqa: E402
from batchrun.layers.fp8_linear import Fp8Linear  # noqa: E402
from batchrun.layers.moe import SparseMoe  # noqa: E402
from tests.helpers.fp8_reference import quantize_blocks, quantized_activations  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def moe_block(
    hidden: int,
    intermediate: int,
    experts: int,
    top_k: int,
    dtype: torch.dtype,
    fp8_block: tuple[int, int] | None = None,
) -> SparseMoe:
    """Random experts; with fp8_block, each expert's weights quantized per block."""
    torch.manual_seed(0)
    block = SparseMoe(hidden, intermediate, experts, top_k, norm_topk=True, fp8_block=fp8_block)
    with torch.no_grad():
        for module in block.modules():
            if isinstance(module, Fp8Linear):
                weight = torch.randn(module.out_features, module.in_features) * 0.2
                module.weight.data, module.weight_scale_inv.data = quantize_blocks(
                    weight, module.block
                )
            elif isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, 0.2)
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


@pytest.mark.parametrize("tokens", [1, 7, 70])
def test_fp8_experts_are_the_quantized_arithmetic(tokens: int) -> None:
    """Each projection's input quantized per row and 32 columns, each expert's weight
    dequantized per 32 x 32 block: in float32, the fused kernel is that arithmetic (a partial
    last block of the intermediate's 80 columns included)."""
    block = moe_block(
        hidden=96, intermediate=80, experts=8, top_k=3, dtype=torch.float32, fp8_block=(32, 32)
    )
    assert block.w13 is not None and block.w2 is not None and block.w13.dtype.itemsize == 1
    assert block.w13_scale is not None and block.w2_scale is not None
    x = torch.randn(tokens, 96, device=DEVICE)
    experts, weights = block.route(x)
    fp8 = (block.w13_scale, block.w2_scale, (32, 32))
    silu_mul = block.swiglus[0].ops.silu_mul
    fused = fused_experts(x, block.w13, block.w2, experts, weights, silu_mul, fp8)
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():
        token, slot = (experts == e).nonzero(as_tuple=True)
        swiglu = block.swiglus[e]
        gate_up = quantized_activations(x[token], 32) @ swiglu.gate_up_proj.dequantized().T
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = quantized_activations(F.silu(gate) * up, 32)
        y = hidden @ swiglu.down_proj.dequantized().T
        out.index_add_(0, token, y * weights[token, slot, None])
    tolerance = 1e-4 if DEVICE.type == "cpu" else 2e-3
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

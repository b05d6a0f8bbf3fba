"""Qwen3-MoE's sparse feed-forward block: a router picks each token's top-k experts (softmax over
all experts in float32, the top k renormalised when norm_topk_prob), and the token's output is
their SwiGLU outputs weighted by those probabilities, as transformers computes it.

The experts are SwiGLU modules under the checkpoint's names (mlp.experts.E.gate_proj, ...);
once loaded, `pack` stacks their weights (and an FP8 checkpoint's block scales) into one tensor
per projection, the experts keeping views of it. On CUDA, when triton imports, the packed experts
run fused (kernels/triton_moe.py: no host synchronisation, so under CUDA graphs; FP8 experts as
block-scaled FP8 matmuls); elsewhere the reference path runs the experts some token chose one
after another, reading the routing on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from batchrun.kernels.dispatch import triton_kernel
from batchrun.layers.mlp import SwiGLU
from batchrun.parallel.group import TensorParallel

FusedExperts = Callable[..., torch.Tensor]


class SparseMoe(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        norm_topk: bool,
        fp8_block: tuple[int, int] | None = None,  # experts kept in FP8 blocks (fp8_linear)
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            SwiGLU(hidden, intermediate, fp8_block) for _ in range(num_experts)
        )
        self.swiglus: list[SwiGLU] = list(self.experts)  # type: ignore[arg-type]
        self.top_k, self.norm_topk, self.fp8_block = top_k, norm_topk, fp8_block
        self.w13: torch.Tensor | None = None  # [E, 2I, H], set by pack()
        self.w2: torch.Tensor | None = None  # [E, H, I]
        self.w13_scale: torch.Tensor | None = None  # FP8: [E, 2I / block, H / block] float32
        self.w2_scale: torch.Tensor | None = None
        # Tensor parallel: each rank's experts hold its share of their intermediate rows, so
        # the block's output is a partial sum, all-reduced once.
        self.tp: TensorParallel | None = None

    @torch.no_grad()
    def pack(self) -> None:
        """Stack the loaded experts' weights (each expert's parameters become views of them)."""
        self.w13 = self._stack("gate_up_proj", "weight")
        self.w2 = self._stack("down_proj", "weight")
        if self.fp8_block is not None:
            self.w13_scale = self._stack("gate_up_proj", "weight_scale_inv")
            self.w2_scale = self._stack("down_proj", "weight_scale_inv")

    def _stack(self, projection: str, name: str) -> torch.Tensor:
        params = [getattr(getattr(e, projection), name) for e in self.swiglus]
        stacked = torch.stack(params)
        for i, param in enumerate(params):
            param.data = stacked[i]
        return stacked

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] and their weights [T, k] (in x's dtype)."""
        probs = self.gate(x).softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        fused = fused_kernel() if x.is_cuda and self.w13 is not None else None
        if fused is not None:
            silu_mul = self.swiglus[0].ops.silu_mul
            fp8 = (self.w13_scale, self.w2_scale, self.fp8_block) if self.fp8_block else None
            out = fused(x, self.w13, self.w2, experts, weights, silu_mul, fp8)
        else:
            out = torch.zeros_like(x)
            for e in experts.unique().tolist():
                token, slot = (experts == e).nonzero(as_tuple=True)
                y = self.swiglus[e](x[token]) * weights[token, slot, None]
                out.index_add_(0, token, y)
        return self.tp.all_reduce(out) if self.tp is not None else out


def fused_kernel() -> FusedExperts | None:
    """The fused experts when triton imports (CUDA tensors), else None: the reference path."""
    kernel: FusedExperts | None = triton_kernel("batchrun.kernels.triton_moe", "fused_experts")
    return kernel


class SharedExpertMoe(SparseMoe):
    """Qwen3.5-MoE's and Qwen3-Next's block: the routed experts (top k renormalised) plus one
    shared SwiGLU expert that every token passes, weighted by sigmoid(shared_expert_gate)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        norm_topk: bool,
        shared_intermediate: int,
        fp8_block: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(hidden, intermediate, num_experts, top_k, norm_topk, fp8_block)
        self.shared_expert = SwiGLU(hidden, shared_intermediate, fp8_block)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(x) * torch.sigmoid(self.shared_expert_gate(x))
        return super().forward(x) + shared

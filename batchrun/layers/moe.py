"""Qwen3-MoE's sparse feed-forward block: a router picks each token's top-k experts (softmax over
all experts in float32, the top k renormalised when norm_topk_prob), and the token's output is
their SwiGLU outputs weighted by those probabilities, as transformers computes it.

The experts are SwiGLU modules under the checkpoint's names (mlp.experts.E.gate_proj, ...). This
is the reference path: it runs the experts that some token chose, one after another, so it reads
the routing on the host and cannot be captured in a CUDA graph (an engine with a MoE target runs
eagerly).
"""

from __future__ import annotations

import torch
from torch import nn

from batchrun.layers.mlp import SwiGLU


class SparseMoe(nn.Module):
    def __init__(
        self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk: bool
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(SwiGLU(hidden, intermediate) for _ in range(num_experts))
        self.top_k, self.norm_topk = top_k, norm_topk

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] and their weights [T, k] (in x's dtype)."""
        probs = self.gate(x).softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            token, slot = (experts == e).nonzero(as_tuple=True)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out

"""The layers that differ under tensor parallelism: row-parallel linears (their partial sums
all-reduced) and the vocabulary-parallel embedding. Column-parallel linears (q/k/v, gate/up) are
the plain ones, built with this rank's share of the heads and intermediate rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.layers.fp8_linear import Fp8Linear
from batchrun.parallel.group import TensorParallel


class RowParallelLinear(nn.Linear):
    """A linear layer holding this rank's columns of the weight (o_proj, down_proj): its input is
    this rank's slice of features, its output the sum over the ranks."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class RowParallelFp8Linear(Fp8Linear):
    """RowParallelLinear over an FP8 checkpoint's block-scaled weight (whole blocks a rank)."""

    def __init__(
        self, in_features: int, out_features: int, block: tuple[int, int], tp: TensorParallel
    ) -> None:
        super().__init__(in_features, out_features, block)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


def row_parallel(
    in_features: int, out_features: int, tp: TensorParallel, fp8_block: tuple[int, int] | None
) -> RowParallelLinear | RowParallelFp8Linear:
    """The row-parallel layer, in FP8 blocks where the checkpoint's are kept."""
    if fp8_block is None:
        return RowParallelLinear(in_features, out_features, tp)
    return RowParallelFp8Linear(in_features, out_features, fp8_block, tp)


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding rows [start, start + num_embeddings) of the vocabulary: each rank
    looks up the ids it holds, zeros the others, and the ranks' rows are summed."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel) -> None:
        self.start, end = tp.bounds(vocab_size)
        super().__init__(end - self.start, hidden)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))

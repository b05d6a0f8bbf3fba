"""The top K of each row of logits over the vocabulary, sorted descending: on CUDA, when triton
imports and the kernel takes K, the two-stage Triton kernel (kernels/triton_topk.py: one read of
the logits; torch.topk's radix kernels took ~0.57 ms over 480 x 152k bf16 rows on an H100, ~5x
an argmax over the same rows); else torch.topk, the CPU path and the reference. Both give the
same values; among equal values the kernel puts the lower index first."""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchrun.kernels.dispatch import cuda_kernel, triton_kernel

TopK = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
_TRITON = "batchrun.kernels.triton_topk"  # its kernel, on CUDA (kernels/dispatch.py)


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (values [..., k] in logits' dtype, indices [..., k] int64)."""
    kernel = _kernel(logits, k)
    if kernel is None:
        values, indices = logits.topk(k, dim=-1)
        return values, indices
    return kernel(logits, k)


def _kernel(logits: torch.Tensor, k: int) -> TopK | None:
    kernel: TopK | None = cuda_kernel(logits, _TRITON, "topk_triton")
    return kernel if kernel is not None and triton_kernel(_TRITON, "supports_k")(k) else None

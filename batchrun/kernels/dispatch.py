"""Where an operation takes its Triton kernel instead of its torch reference: on CUDA tensors,
when triton imports. One rule for every such pair; the CPU, and an image without triton, keep
the reference."""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch


@functools.cache
def triton_kernel(module: str, name: str) -> Any:
    """`module`.`name`, or None when the module cannot be imported (no triton)."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


def cuda_kernel(x: torch.Tensor, module: str, name: str) -> Any:
    """triton_kernel(module, name) for a CUDA tensor `x`, else None."""
    return triton_kernel(module, name) if x.is_cuda else None

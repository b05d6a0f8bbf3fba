"""A checkpoint's tensors as meta tensors read from its safetensors headers alone: what the
start-up checks hand the loaders' own name and shape checks, so that no weight is read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from batchrun.models.loader import fp8_weights, safetensors_files
from batchrun.models.qwen3 import Qwen3Shape
from batchrun.models.safetensors_reader import file_header


def header_weights(
    model_dir: Path, shape: Qwen3Shape, what: str, model: nn.Module | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """header_tensors as the loader gives them to `model` (FP8 weights it does not keep
    dequantized), on the meta device."""
    return fp8_weights(header_tensors(model_dir), shape, what, model)


def header_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """iter_safetensors's (name, tensor) pairs, in its order, as meta tensors from the headers
    alone; the same JobError where it would raise one on a header."""
    for file in safetensors_files(model_dir):
        for entry in file_header(file).entries:
            yield entry.name, torch.empty(entry.shape, dtype=entry.dtype, device="meta")

"""FP8 done by hand, for the tests: weights quantized per block as Qwen's -FP8 checkpoints are
(a tensor, or a whole checkpoint written beside its dequantized twin), and activations as the
kernels feed them to their dots."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from batchrun.attention.kv_dtype import FP8_MAX
from batchrun.models.fp8 import SCALE_SUFFIX

QUANTIZED = ("proj.weight",)  # the linear layers; embeddings, norms and the head stay as they are


def quantize_blocks(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [n, k] as float8_e4m3fn and its float32 scale per block (weight_scale_inv)."""
    n, k = weight.shape
    rows, cols = -(-n // block[0]), -(-k // block[1])
    padded = F.pad(weight.float(), (0, cols * block[1] - k, 0, rows * block[0] - n))
    amax = padded.reshape(rows, block[0], cols, block[1]).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    full = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (weight / full).to(torch.float8_e4m3fn), scale


def quantized_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the kernels feed it to the dot: per row and group of columns, scaled to FP8's range,
    rounded to float8_e4m3fn and scaled back (float32)."""
    m, k = x.shape
    groups = -(-k // group)
    g = F.pad(x.float(), (0, groups * group - k)).reshape(m, groups, group)
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return ((g / scale).to(torch.float8_e4m3fn).float() * scale).reshape(m, -1)[:, :k]


def quantize(source: Path, out: Path, block: list[int] | None) -> Path:
    """A copy of the checkpoint with its projections in float8_e4m3fn and their scales, and
    beside it (out/../reference) the same checkpoint with those weights dequantized."""
    tensors = load_file(source / "model.safetensors")
    quantized, reference = {}, {}
    for name, weight in tensors.items():
        if not name.endswith(QUANTIZED):
            quantized[name] = reference[name] = weight
            continue
        rows, cols = weight.shape
        br, bc = block or [rows, cols]
        q, scale = quantize_blocks(weight, (br, bc))
        quantized[name] = q
        quantized[name + SCALE_SUFFIX] = scale if block else scale.reshape(())
        reference[name] = q.float() * scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)
    config = json.loads((source / "config.json").read_text())
    for directory, weights, extra in (
        (
            out,
            quantized,
            {
                "quantization_config": {
                    "quant_method": "fp8",
                    "activation_scheme": "dynamic",
                    "fmt": "e4m3",
                    "weight_block_size": block,
                }
            },
        ),
        (out.parent / f"{out.name}-reference", reference, {}),
    ):
        directory.mkdir()
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps({**config, **extra}))
        for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / name, directory / name)
    return out

"""Qwen3-Next's Gated DeltaNet projections in Qwen3.5's layout: its checkpoint interleaves
in_proj_qkvz rows by key-head group ([q, k, v, z] of each group's heads) and in_proj_ba rows
([b, a] of each group); batchrun's layer takes in_proj_qkv (all q, all k, all v), in_proj_z,
in_proj_b and in_proj_a."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from batchrun.models.qwen3_5 import Qwen3_5Shape


def qwen3_next_weights(
    tensors: Iterator[tuple[str, torch.Tensor]], shape: Qwen3_5Shape
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors, the interleaved projections split into Qwen3.5's (dequantized weights)."""
    groups = shape.linear_num_key_heads
    per = shape.linear_num_value_heads // groups  # value heads per key head
    dk, dv = shape.linear_key_head_dim, shape.linear_value_head_dim
    for name, tensor in tensors:
        if name.endswith("in_proj_qkvz.weight"):
            stem = name.removesuffix("in_proj_qkvz.weight")
            q, k, v, z = tensor.view(groups, -1, tensor.shape[-1]).split(
                (dk, dk, per * dv, per * dv), dim=1
            )
            qkv = torch.cat([part.reshape(-1, tensor.shape[-1]) for part in (q, k, v)])
            yield stem + "in_proj_qkv.weight", qkv
            yield stem + "in_proj_z.weight", z.reshape(-1, tensor.shape[-1])
        elif name.endswith("in_proj_ba.weight"):
            stem = name.removesuffix("in_proj_ba.weight")
            b, a = tensor.view(groups, 2 * per, -1).split((per, per), dim=1)
            yield stem + "in_proj_b.weight", b.reshape(-1, tensor.shape[-1])
            yield stem + "in_proj_a.weight", a.reshape(-1, tensor.shape[-1])
        else:
            yield name, tensor

"""How a Qwen3 target is split across tensor-parallel ranks.

Each rank holds a contiguous share of the attention heads (its query heads with the KV heads
they read, so its KV pages hold only those), of the MLP's intermediate rows (of every expert's,
in a MoE layer, whose router is replicated) and of the vocabulary. q/k/v and gate/up are
column-parallel (the rank's output rows), o_proj and down_proj row-parallel (the matching input
columns, partial sums all-reduced; a MoE layer's once, after its experts), embed_tokens and
lm_head vocabulary-parallel; norms are replicated. A rank's model is the single-process model
built with its local shape, the row-parallel, embedding and lm_head layers swapped for their
parallel ones. An FP8 checkpoint's projections stay in FP8 where every rank's share is whole
blocks (their scales split with them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from torch import nn

from batchrun.errors import JobError
from batchrun.layers.attention import PagedAttention
from batchrun.layers.mlp import SwiGLU
from batchrun.layers.moe import SparseMoe
from batchrun.layers.parallel_logits import gather_logits, greedy_tokens
from batchrun.layers.tensor_parallel import VocabParallelEmbedding, row_parallel
from batchrun.models.fp8 import SCALE_SUFFIX
from batchrun.models.qwen3 import Qwen3ForCausalLM, Qwen3Shape
from batchrun.parallel.group import TensorParallel

# Checkpoint tensor (its last two name parts) -> the dimension split across ranks. Splitting the
# rows of q/k/v by even blocks gives each rank whole heads, since the heads divide evenly. An
# FP8 weight's block scales split along the same dimension (each rank's share: whole blocks).
SPLIT_DIM = {
    f"{proj}.{leaf}": dim
    for projs, dim in (
        (("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), 0),
        (("o_proj", "down_proj"), 1),
    )
    for proj in projs
    for leaf in ("weight", "weight" + SCALE_SUFFIX)
} | {"embed_tokens.weight": 0, "lm_head.weight": 0}


def local_shape(shape: Qwen3Shape, tp: TensorParallel) -> Qwen3Shape:
    """The shape of this rank's share: its heads and intermediate rows (vocab_size stays the
    whole vocabulary's: what tokens exist, whatever slice of them a rank's logits hold)."""
    for what, count in (
        ("attention heads", shape.num_heads),
        ("KV heads", shape.num_kv_heads),
        ("intermediate rows", shape.intermediate_size),
        ("expert intermediate rows", shape.moe_intermediate_size),
    ):
        if count % tp.world_size:
            raise JobError(
                f"tensor parallel size {tp.world_size} does not divide the target's {count} {what}"
            )
    local = dataclasses.replace(
        shape,
        num_heads=shape.num_heads // tp.world_size,
        num_kv_heads=shape.num_kv_heads // tp.world_size,
        intermediate_size=shape.intermediate_size // tp.world_size,
        moe_intermediate_size=shape.moe_intermediate_size // tp.world_size,
    )
    # A rank keeps its share of an FP8 checkpoint in FP8 where the share is whole blocks: the
    # column-parallel rows (local.fp8_block checks them) and the row-parallel input columns of
    # o_proj and down_proj; otherwise the checkpoint is dequantized as it loads.
    block = local.fp8_block
    columns = [local.num_heads * local.head_dim, local.intermediate_size]
    columns += [local.moe_intermediate_size] if local.num_experts else []
    if block is None or any(c % block[1] for c in columns):
        local = dataclasses.replace(local, fp8=None)
    return local


def fp8_kept(shape: Qwen3Shape, world_size: int) -> bool:
    """Whether an FP8 checkpoint's projections stay in FP8 on `world_size` ranks: every rank's
    share whole blocks (one process: the shape's own rule)."""
    if world_size == 1:
        return shape.fp8_block is not None
    any_rank = TensorParallel(0, world_size, torch.device("cpu"))  # every share has one shape
    return local_shape(shape, any_rank).fp8_block is not None


class TensorParallelQwen3(Qwen3ForCausalLM):
    """This rank's Qwen3 (shape: the whole model's): its logits are its vocabulary slice's;
    argmax and full_logits work across the ranks, and every rank gets the same result."""

    def __init__(self, shape: Qwen3Shape, tp: TensorParallel) -> None:
        local = local_shape(shape, tp)
        super().__init__(local)
        self.tp = tp
        fp8 = local.fp8_block
        experts = set()
        for module in list(self.modules()):
            if isinstance(module, SparseMoe):  # its experts' partial sums: one all-reduce
                module.tp = tp
                experts |= {id(expert) for expert in module.experts}
        for module in list(self.modules()):
            if isinstance(module, PagedAttention):
                module.o_proj = row_parallel(module.q_size, shape.hidden_size, tp, fp8)
            elif isinstance(module, SwiGLU) and id(module) not in experts:
                module.down_proj = row_parallel(local.intermediate_size, shape.hidden_size, tp, fp8)
        embed = VocabParallelEmbedding(shape.vocab_size, shape.hidden_size, tp)
        self.model.embed_tokens = embed
        self.lm_head = nn.Linear(shape.hidden_size, embed.num_embeddings, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = embed.weight

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return greedy_tokens(logits, self.tp, self.shape.vocab_size)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return gather_logits(logits, self.tp, self.shape.vocab_size)


def shard_tensor(name: str, tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of a checkpoint tensor (the whole of a replicated one)."""
    dim = SPLIT_DIM.get(".".join(name.split(".")[-2:]))
    if dim is None:
        return tensor
    start, end = tp.bounds(tensor.shape[dim])
    return tensor.narrow(dim, start, end - start)


def shard_checkpoint(
    tensors: Iterator[tuple[str, torch.Tensor]], tp: TensorParallel
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        yield name, shard_tensor(name, tensor, tp)

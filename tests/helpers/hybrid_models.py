"""Tiny random hybrid checkpoints written by transformers, and a packed step driver over
batchrun's paged KV and linear state slots, for the Qwen3.5 / Qwen3-Next tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from batchrun.attention.meta import AttentionMeta, allocate_kv
from batchrun.attention.torch_backend import TorchAttention
from batchrun.layers.linear_attention import LinearStepMeta
from batchrun.models.qwen3_5 import LayerCache, Qwen3_5ForCausalLM, allocate_linear_states

VOCAB = 300
PAGE = 4
PAGES_PER_SLOT = 32
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=8,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=256,
    initializer_range=0.2,
    dtype="float32",
)
EXPERTS = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)
VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    num_position_embeddings=16,
)
KINDS = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_5")


def make_hybrid(out: Path, kind: str, seed: int = 0) -> nn.Module:
    """Save a random model of `kind` (KINDS) to out; returns transformers' model."""
    torch.manual_seed(seed)
    moe_text = {k: v for k, v in TEXT.items() if k != "intermediate_size"} | EXPERTS
    model: Any
    if kind == "qwen3_5_text":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT))
    elif kind == "qwen3_5_moe_text":
        config = transformers.Qwen3_5MoeTextConfig(**moe_text)
        model = transformers.Qwen3_5MoeForCausalLM(config)
    elif kind == "qwen3_next":
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**TEXT, **EXPERTS))
    else:
        config = transformers.Qwen3_5Config(text_config=TEXT, vision_config=VISION)
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    with torch.no_grad():  # norms and gates away from their init, so a misread one shows
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "dt_bias", "A_log")):
                param.copy_(torch.randn_like(param) * 0.3)
    model.eval().save_pretrained(str(out))
    return model


def with_tokenizer(out: Path, tokenizer: Path) -> None:
    """Copy a tokenizer's files beside a checkpoint."""
    for file in tokenizer.iterdir():
        (out / file.name).write_bytes(file.read_bytes())


class Stepper:
    """Runs packed steps of a Qwen3_5ForCausalLM on the CPU: slot s owns KV pages
    s * PAGES_PER_SLOT onwards and linear state slot s."""

    def __init__(self, model: Qwen3_5ForCausalLM, slots: int, max_width: int = 4) -> None:
        s = model.shape
        self.model, self.backend = model, TorchAttention()
        kv = allocate_kv(
            s.num_layers,
            slots * PAGES_PER_SLOT,
            PAGE,
            s.num_kv_heads,
            s.head_dim,
            torch.float32,
            torch.device("cpu"),
        )
        linear = allocate_linear_states(
            s, slots, slots, max_width, torch.float32, torch.device("cpu")
        )
        self.caches: list[LayerCache] = [linear.get(i, kv[i]) for i in range(s.num_layers)]

    def step(
        self,
        decode: list[tuple[int, list[int], int]],  # (slot, W tokens, first position)
        prefill: list[tuple[int, list[int], int]],  # (slot, chunk tokens, first position)
    ) -> tuple[torch.Tensor, LinearStepMeta]:
        """Logits [T, V] of the step's rows, and its meta."""
        items = decode + prefill
        ids = torch.tensor([t for _, tokens, _ in items for t in tokens])
        positions = torch.tensor([p + i for _, tokens, p in items for i in range(len(tokens))])
        req = torch.tensor([r for r, (_, tokens, _) in enumerate(items) for _ in tokens])
        slot = torch.tensor([s for s, _, _ in items])
        table = (slot[:, None] * PAGES_PER_SLOT + torch.arange(PAGES_PER_SLOT)).int()
        lens = [len(tokens) for _, tokens, _ in items]
        kv_lens = [p + n for (_, _, p), n in zip(items, lens, strict=True)]
        pages = table[req, positions // PAGE].long()
        meta = AttentionMeta(
            positions=positions,
            kv_index=pages * PAGE + positions % PAGE,
            cu_q=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
            page_table=table,
            page_size=PAGE,
            max_q=max(lens),
            max_kv=max(kv_lens),
        )
        self.backend.plan(meta)
        linear = LinearStepMeta(
            slots=slot,
            decoding=len(decode),
            q_lens=torch.tensor([len(tokens) for _, tokens, _ in decode], dtype=torch.int64),
            max_q=max((len(tokens) for _, tokens, _ in decode), default=1),
            decode_rows=sum(len(tokens) for _, tokens, _ in decode),
            prefill_lens=tuple(len(tokens) for _, tokens, _ in prefill),
            prefill_fresh=tuple(p == 0 for _, _, p in prefill),
        )
        hidden, _ = self.model(ids, positions, self.backend, self.caches, linear=linear)
        return self.model.logits(hidden), linear

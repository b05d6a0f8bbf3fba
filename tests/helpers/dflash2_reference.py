"""A plain DFlash2 reference, written straight from docs/dflash.md's DFlash2 section for the
tests: one request, no pages, no cache, plain torch over the safetensors tensors; the target is
transformers' model, re-run over the whole sequence each round (dflash_reference.py's target
side and DFlash's block attention, which DFlash2 keeps).

What DFlash2 adds, as the section states it:
- each layer: h = conv_a.in(input_norm(x)); x = x + conv_a.out(attention(h)); then
  h = conv_m.in(post_norm(x)); x = x + conv_m.out(mlp(h)), where conv.in and conv.out mix
  block row t with row t - 1 of the same block (none before row 0) through kernel
  base[side][tap][c] + dyn[t][side][tap][c // group], dyn = kernel_projection(conv.in's input);
- logits = softcap(lm_head(norm(x)) * output_multiplier), softcap(z) = c * tanh(z / c);
- the greedy walk: from the anchor, at each row i = 1 .. B-1, among the row's top-K tokens c,
  the one with the largest logit(c) + <P[prev] * (W_h norm(x_i)), S[c]> (the first on a tie,
  candidates in descending logit order), which becomes prev.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from tests.helpers.dflash_reference import (
    Draft,
    RefRound,
    attention,
    load_target,
    read_draft,
    rms_norm,
    rope,
    target_pass,
    visible_keys,
)


@dataclass(frozen=True)
class Draft2:
    base: Draft  # DFlash's part: layers, features, block, mask, windows
    group: int
    top_k: int
    softcap: float | None
    multiplier: float


def read_draft2(draft_dir: Path | str) -> Draft2:
    own = json.loads((Path(draft_dir) / "config.json").read_text())["dflash_config"]
    assert own["conv_kernel_size"] == 2
    return Draft2(
        base=read_draft(draft_dir),
        group=own["conv_group_size"],
        top_k=own["selector_top_k"],
        softcap=own.get("final_logit_softcapping"),
        multiplier=own.get("output_multiplier", 1.0),
    )


def conv(x: torch.Tensor, base: torch.Tensor, dyn: torch.Tensor, group: int) -> torch.Tensor:
    """x [B, H] one block's rows; base [2 taps, H]; dyn [B, 2 taps, H / group]."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for tap in range(2):
            if t - tap < 0:
                continue  # zero across the block boundary
            kernel = base[tap] + dyn[t, tap].repeat_interleave(group)
            out[t] += kernel * x[t - tap]
    return out


def draft_hidden2(
    draft: Draft2, ctx_features: torch.Tensor, block_embeds: torch.Tensor
) -> torch.Tensor:
    """The final-normed block rows [B, H] of one block (dflash_reference.draft_hidden, with the
    convolutions): ctx_features [p, n * H] of positions 0 .. p-1, block_embeds [B, H]."""
    d = draft.base
    w, eps, hd = d.weights, d.rms_norm_eps, d.head_dim
    p, width = ctx_features.shape[0], block_embeds.shape[0]
    ctx_pos, blk_pos = torch.arange(p), torch.arange(p, p + width)
    k_pos = torch.cat([ctx_pos, blk_pos])
    ctx = rms_norm(ctx_features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)

    def heads(rows: torch.Tensor, weight: str, num: int) -> torch.Tensor:
        return (rows @ w[weight].T).unflatten(-1, (num, hd))

    def kv(a: str, rows: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = rms_norm(heads(rows, a + "k_proj.weight", d.num_kv_heads), w[a + "k_norm.weight"], eps)
        return rope(k, pos, d.rope_theta), heads(rows, a + "v_proj.weight", d.num_kv_heads)

    def kernels(c: str, h: torch.Tensor) -> torch.Tensor:  # [B, side, tap, groups]
        return (h @ w[c + "kernel_projection.weight"].T).view(width, 2, 2, -1)

    x = block_embeds
    for i in range(d.num_layers):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        ca, cm = f"layers.{i}.attention_conv.", f"layers.{i}.mlp_conv."
        h = rms_norm(x, w[f"layers.{i}.input_layernorm.weight"], eps)
        dyn = kernels(ca, h)
        h = conv(h, w[ca + "base_kernel"][0], dyn[:, 0], draft.group)
        q = rms_norm(heads(h, a + "q_proj.weight", d.num_heads), w[a + "q_norm.weight"], eps)
        q = rope(q, blk_pos, d.rope_theta)
        k_ctx, v_ctx = kv(a, ctx, ctx_pos)
        k_blk, v_blk = kv(a, h, blk_pos)
        visible = visible_keys(blk_pos, k_pos, d.windows[i], d.causal[i])
        o = attention(q, torch.cat([k_ctx, k_blk]), torch.cat([v_ctx, v_blk]), visible)
        x = x + conv(o @ w[a + "o_proj.weight"].T, w[ca + "base_kernel"][1], dyn[:, 1], draft.group)
        h = rms_norm(x, w[f"layers.{i}.post_attention_layernorm.weight"], eps)
        dyn = kernels(cm, h)
        h = conv(h, w[cm + "base_kernel"][0], dyn[:, 0], draft.group)
        gated = F.silu(h @ w[m + "gate_proj.weight"].T) * (h @ w[m + "up_proj.weight"].T)
        x = x + conv(
            gated @ w[m + "down_proj.weight"].T, w[cm + "base_kernel"][1], dyn[:, 1], draft.group
        )
    return rms_norm(x, w["norm.weight"], eps)


def propose(
    draft: Draft2, target: PreTrainedModel, ctx_features: torch.Tensor, anchor: int
) -> list[int]:
    """The greedy walk's drafts d1 .. d_{B-1} after ctx_features [p, n * H]."""
    d = draft.base
    block = torch.tensor([anchor] + [d.mask_token_id] * (d.block_size - 1))
    with torch.no_grad():
        rows = draft_hidden2(draft, ctx_features, target.model.embed_tokens.weight[block])[1:]
        logits = (rows @ target.lm_head.weight.T) * draft.multiplier
        if draft.softcap is not None:
            logits = torch.tanh(logits / draft.softcap) * draft.softcap
        unary, candidates = logits.topk(draft.top_k, dim=-1)
        w = d.weights
        proj = rows @ w["candidate_selector.hidden_projection.weight"].T
        pred = w["candidate_selector.predecessor_codebook"]
        succ = w["candidate_selector.successor_codebook"]
        prev, drafts = anchor, []
        for i in range(d.block_size - 1):
            scores = unary[i] + (succ[candidates[i]] * (pred[prev] * proj[i])).sum(-1)
            prev = int(candidates[i, int(scores.argmax())])
            drafts.append(prev)
    return drafts


def reference_generate2(
    target_dir: Path | str,
    draft_dir: Path | str,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int],
) -> tuple[list[int], list[RefRound]]:
    """Greedy DFlash2 generation: (generated ids, every verify round), each round verifying
    the anchor and the whole block's drafts."""
    target, draft = load_target(target_dir), read_draft2(draft_dir)
    layer_ids, width = draft.base.target_layer_ids, draft.base.block_size
    logits, feats = target_pass(target, prompt_ids, layer_ids)
    out = [int(logits[-1].argmax())]
    rounds: list[RefRound] = []
    while out[-1] not in eos_ids and len(out) < max_new_tokens:
        seq = list(prompt_ids) + out
        p, anchor = len(seq) - 1, out[-1]
        drafts = propose(draft, target, feats[:p], anchor)
        logits, feats = target_pass(target, seq + drafts, layer_ids)
        post = logits[p : p + width].argmax(-1).tolist()
        acc = 0
        while acc < width - 1 and drafts[acc] == post[acc]:
            acc += 1
        committed = post[: acc + 1]
        for i, token in enumerate(committed):
            if token in eos_ids:
                committed = committed[: i + 1]
                break
        committed = committed[: max_new_tokens - len(out)]
        out += committed
        rounds.append(RefRound(p, anchor, drafts, committed))
    return out, rounds


def reference_drafts2(
    target_dir: Path | str, draft_dir: Path | str, sequence: Sequence[int], positions: list[int]
) -> dict[int, list[int]]:
    """The reference's drafts for a block anchored at each of `positions` of a sequence."""
    target, draft = load_target(target_dir), read_draft2(draft_dir)
    _, feats = target_pass(target, sequence, draft.base.target_layer_ids)
    return {p: propose(draft, target, feats[:p], sequence[p]) for p in positions}

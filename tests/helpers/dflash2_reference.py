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
from collections.abc import Callable, Sequence
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
    """x [..., B, H] a block's rows; base [2 taps, H]; dyn [..., B, 2 taps, H / group]: row t
    is kernel[t, 0] * x[t] + kernel[t, 1] * x[t - 1], no x[-1] (zero across the boundary)."""
    kernel = base + dyn.repeat_interleave(group, dim=-1)  # [..., B, 2, H]
    previous = torch.cat([torch.zeros_like(x[..., :1, :]), x[..., :-1, :]], dim=-2)
    return kernel[..., 0, :] * x + kernel[..., 1, :] * previous


def draft_hidden2(
    draft: Draft2, ctx_features: torch.Tensor, block_embeds: torch.Tensor
) -> torch.Tensor:
    """The final-normed block rows [..., B, H] (dflash_reference.draft_hidden, with the
    convolutions): ctx_features [..., p, n * H] of positions 0 .. p-1, block_embeds [..., B, H]
    (leading dims: independent blocks of the same p, for training)."""
    d = draft.base
    w, eps, hd = d.weights, d.rms_norm_eps, d.head_dim
    p, width = ctx_features.shape[-2], block_embeds.shape[-2]
    ctx_pos, blk_pos = torch.arange(p), torch.arange(p, p + width)
    k_pos = torch.cat([ctx_pos, blk_pos])
    ctx = rms_norm(ctx_features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)

    def heads(rows: torch.Tensor, weight: str, num: int) -> torch.Tensor:
        return (rows @ w[weight].T).unflatten(-1, (num, hd))

    def kv(a: str, rows: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = rms_norm(heads(rows, a + "k_proj.weight", d.num_kv_heads), w[a + "k_norm.weight"], eps)
        return rope(k, pos, d.rope_theta), heads(rows, a + "v_proj.weight", d.num_kv_heads)

    def around(c: str, h: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]):
        """conv.out(sublayer(conv.in(h))), both kernels projected from h."""
        dyn = (h @ w[c + "kernel_projection.weight"].T).unflatten(-1, (2, 2, -1))
        base = w[c + "base_kernel"]
        inner = sublayer(conv(h, base[0], dyn[..., 0, :, :], draft.group))
        return conv(inner, base[1], dyn[..., 1, :, :], draft.group)

    x = block_embeds
    for i in range(d.num_layers):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."

        def attend(h: torch.Tensor, a: str = a, i: int = i) -> torch.Tensor:
            q = rms_norm(heads(h, a + "q_proj.weight", d.num_heads), w[a + "q_norm.weight"], eps)
            q = rope(q, blk_pos, d.rope_theta)
            k_ctx, v_ctx = kv(a, ctx, ctx_pos)  # context rows: no conv, layernorm or MLP
            k_blk, v_blk = kv(a, h, blk_pos)
            visible = visible_keys(blk_pos, k_pos, d.windows[i], d.causal[i])
            k, v = torch.cat([k_ctx, k_blk], -3), torch.cat([v_ctx, v_blk], -3)
            return attention(q, k, v, visible) @ w[a + "o_proj.weight"].T

        def mlp(h: torch.Tensor, m: str = m) -> torch.Tensor:
            gated = F.silu(h @ w[m + "gate_proj.weight"].T) * (h @ w[m + "up_proj.weight"].T)
            return gated @ w[m + "down_proj.weight"].T

        h = rms_norm(x, w[f"layers.{i}.input_layernorm.weight"], eps)
        x = x + around(f"layers.{i}.attention_conv.", h, attend)
        h = rms_norm(x, w[f"layers.{i}.post_attention_layernorm.weight"], eps)
        x = x + around(f"layers.{i}.mlp_conv.", h, mlp)
    return rms_norm(x, w["norm.weight"], eps)


def block_logits(
    draft: Draft2, target: PreTrainedModel, ctx_features: torch.Tensor, anchors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(softcapped, scaled logits [..., B-1, V], the selector's projection [..., B-1, rank]) of
    block rows 1 .. B-1 for anchors [...] after ctx_features [..., p, n * H]."""
    d = draft.base
    mask = torch.full((*anchors.shape, d.block_size - 1), d.mask_token_id)
    block = torch.cat([anchors[..., None], mask], dim=-1)
    rows = draft_hidden2(draft, ctx_features, target.model.embed_tokens.weight[block])[..., 1:, :]
    logits = (rows @ target.lm_head.weight.T) * draft.multiplier
    if draft.softcap is not None:
        logits = torch.tanh(logits / draft.softcap) * draft.softcap
    proj = rows @ d.weights["candidate_selector.hidden_projection.weight"].T
    return logits, proj


def edges(draft: Draft2, previous: torch.Tensor, proj: torch.Tensor, candidates: torch.Tensor):
    """<P[previous] * proj, S[c]> for each candidate c: previous [...], proj [..., rank],
    candidates [..., K] -> [..., K]."""
    w = draft.base.weights
    pred = w["candidate_selector.predecessor_codebook"][previous]
    succ = w["candidate_selector.successor_codebook"][candidates]
    return (succ * (pred * proj)[..., None, :]).sum(-1)


def propose(
    draft: Draft2, target: PreTrainedModel, ctx_features: torch.Tensor, anchor: int
) -> list[int]:
    """The greedy walk's drafts d1 .. d_{B-1} after ctx_features [p, n * H]."""
    with torch.no_grad():
        logits, proj = block_logits(draft, target, ctx_features, torch.tensor(anchor))
        unary, candidates = logits.topk(draft.top_k, dim=-1)
        previous, drafts = torch.tensor(anchor), []
        for i in range(draft.base.block_size - 1):
            scores = unary[i] + edges(draft, previous, proj[i], candidates[i])
            previous = candidates[i, scores.argmax()]  # the first of equal maxima
            drafts.append(int(previous))
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

"""A plain DFlash reference, written straight from docs/dflash.md for the tests, with the
variants beyond it: sliding-window layers (a row at position q sees positions > q - W; causal
in the block where the format says so), a reduced draft vocabulary (the draft's own lm_head,
then target id = draft id + d2t[draft id]) and the speculators config format.

One request at a time, no pages, no batching, no KV cache: the target is transformers' own model
of its checkpoint (Qwen3ForCausalLM, or a hybrid Gated DeltaNet's Qwen3_5ForCausalLM), re-run
over the whole sequence every round, and the draft is its safetensors tensors used with plain
torch ops over an explicit mask. Clarity over speed; from batchrun it
takes only the default target layer ids (a config formula that tests check on their own).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3Config

from batchrun.models.dflash import default_target_layer_ids


class RefRound(NamedTuple):
    position: int  # p, the anchor's position
    anchor: int
    drafts: list[int]  # d1 .. d_{B-1}
    committed: list[int]  # post[0 .. acc], cut at eos / max_new_tokens


@dataclass(frozen=True)
class Draft:
    weights: dict[str, torch.Tensor]  # the z-lab tensor names, no prefix (lm_head, d2t, t2d)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    windows: list[int | None]  # per layer: W of a sliding layer, None for full attention
    causal: list[bool]  # per layer: block rows see only the block rows up to their own

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """A reduced vocabulary's tokens as target ids (d2t holds offsets)."""
        d2t = self.weights.get("d2t")
        return draft_ids if d2t is None else draft_ids + d2t[draft_ids]


def read_draft(draft_dir: Path | str) -> Draft:
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    if "speculators_model_type" in config:  # the draft's own config, defaults filled in
        layers = Qwen3Config(**config["transformer_layer_config"]).to_dict()
        block_size, mask_id = config["block_size"], config["mask_token_id"]
        # Hidden-state index k (0: the embeddings) is the output of target layer k - 1.
        layer_ids = [k - 1 for k in config["aux_hidden_state_layer_ids"]]
        causal_override = None
        sliding_causal = not config.get("sliding_window_non_causal", False)
    else:
        layers, dflash = config, config.get("dflash_config") or {}
        block_size = config.get("block_size", dflash.get("block_size"))
        mask_id = dflash["mask_token_id"]
        layer_ids = dflash.get("target_layer_ids")
        if layer_ids is None:
            layer_ids = default_target_layer_ids(
                config["num_hidden_layers"], config["num_target_layers"]
            )
        causal_override = config.get("is_causal", dflash.get("causal"))
        sliding_causal = True
    heads = layers["num_attention_heads"]
    num_layers = layers["num_hidden_layers"]
    types = layers.get("layer_types") or ["full_attention"] * num_layers
    window = layers["sliding_window"] if layers.get("use_sliding_window") else None
    windows = [window if t == "sliding_attention" else None for t in types]
    causal = [sliding_causal and w is not None for w in windows]
    if causal_override is not None:
        causal = [bool(causal_override)] * num_layers
    rope = layers.get("rope_parameters") or {}
    return Draft(
        weights=load_file(str(Path(draft_dir) / "model.safetensors")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=layers.get("num_key_value_heads") or heads,
        head_dim=layers.get("head_dim") or layers["hidden_size"] // heads,
        rms_norm_eps=layers.get("rms_norm_eps", 1e-6),
        rope_theta=layers.get("rope_theta") or rope.get("rope_theta"),
        block_size=block_size,
        target_layer_ids=list(layer_ids),
        mask_token_id=mask_id,
        windows=windows,
        causal=causal,
    )


@lru_cache(maxsize=8)
def _cached_target(path: str, mtime_ns: int) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval().requires_grad_(False)


def load_target(target_dir: Path | str) -> PreTrainedModel:
    """The HF target (its model_type's class) in float32, loaded once per checkpoint (the key
    includes its mtime)."""
    weights = sorted(Path(target_dir).glob("*.safetensors"))
    return _cached_target(str(target_dir), max(w.stat().st_mtime_ns for w in weights))


@contextmanager
def one_thread() -> Iterator[None]:
    """Tiny ops run fastest on one thread, and far slower when cores are oversubscribed."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---- target side (dflash.md section 2) ----


@contextmanager
def _layer_outputs(target: PreTrainedModel, layer_ids: Sequence[int]) -> Iterator[dict]:
    """Capture each listed decoder layer's output. This equals HF's hidden_states[l + 1] except
    for the last layer, where HF applies the final norm and the spec wants the pre-norm stream."""
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for layer_id in set(layer_ids):

        def hook(_module, _args, output, layer_id: int = layer_id) -> None:
            captured[layer_id] = output[0] if isinstance(output, tuple) else output

        hooks.append(target.model.layers[layer_id].register_forward_hook(hook))
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()


def target_pass(
    target: PreTrainedModel, ids: Sequence[int], layer_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal forward over ids from position 0: (logits [T, V], features f [T, n * H])."""
    with torch.no_grad(), _layer_outputs(target, layer_ids) as captured:
        out = target(torch.tensor([list(ids)]), output_hidden_states=True)
    feats = torch.cat([captured[layer_id][0] for layer_id in layer_ids], dim=-1)
    return out.logits[0], feats


# ---- draft side (dflash.md section 3) ----


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox (rotate-half) RoPE of x [..., T, heads, head_dim] at positions [T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """q [..., Tq, Hq, d], k/v [..., Tk, Hkv, d] -> [..., Tq, Hq * d]; query i sees key j where
    visible[i, j] (GQA: query head h reads kv head h // (Hq / Hkv))."""
    groups = q.shape[-2] // k.shape[-2]
    k, v = k.repeat_interleave(groups, dim=-2), v.repeat_interleave(groups, dim=-2)
    scores = torch.einsum("...qhd,...khd->...hqk", q, k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("...hqk,...khd->...qhd", scores.softmax(dim=-1), v)
    return out.flatten(-2)


def visible_keys(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, causal: bool
) -> torch.Tensor:
    """[Tq, Tk]: which keys each block row sees. Context keys sit before every row; a sliding
    layer drops keys at or before q - W; a causal one the block rows after the row's own."""
    visible = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    if causal:
        visible &= k_pos[None, :] <= q_pos[:, None]
    return visible


def draft_hidden(
    draft: Draft, ctx_features: torch.Tensor, block_embeds: torch.Tensor
) -> torch.Tensor:
    """The draft's final-normed block rows [..., B, H].

    ctx_features [..., p, n * H] are the features of positions 0 .. p-1 (every committed token
    but the anchor); block_embeds [..., B, H] are the target embeddings of [anchor, MASK, ...]
    at positions p .. p+B-1. Leading dims batch independent blocks of the same p (training).
    Recomputing the context K/V each call equals the spec's persistent cache: a context row's
    K/V depend only on its own feature and position.
    """
    w, eps, d = draft.weights, draft.rms_norm_eps, draft.head_dim
    p, width = ctx_features.shape[-2], block_embeds.shape[-2]
    ctx_pos, blk_pos = torch.arange(p), torch.arange(p, p + width)
    ctx = rms_norm(ctx_features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)

    def heads(rows: torch.Tensor, weight: str, num: int) -> torch.Tensor:
        return (rows @ w[weight].T).unflatten(-1, (num, d))

    def kv(a: str, rows: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = rms_norm(
            heads(rows, a + "k_proj.weight", draft.num_kv_heads), w[a + "k_norm.weight"], eps
        )
        return rope(k, pos, draft.rope_theta), heads(rows, a + "v_proj.weight", draft.num_kv_heads)

    k_pos = torch.cat([ctx_pos, blk_pos])
    x = block_embeds
    for i in range(draft.num_layers):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        h = rms_norm(x, w[f"layers.{i}.input_layernorm.weight"], eps)
        q = rms_norm(heads(h, a + "q_proj.weight", draft.num_heads), w[a + "q_norm.weight"], eps)
        q = rope(q, blk_pos, draft.rope_theta)
        k_ctx, v_ctx = kv(a, ctx, ctx_pos)  # context rows: no layernorm, residual or MLP
        k_blk, v_blk = kv(a, h, blk_pos)
        visible = visible_keys(blk_pos, k_pos, draft.windows[i], draft.causal[i])
        k, v = torch.cat([k_ctx, k_blk], -3), torch.cat([v_ctx, v_blk], -3)
        o = attention(q, k, v, visible)
        x = x + o @ w[a + "o_proj.weight"].T
        h = rms_norm(x, w[f"layers.{i}.post_attention_layernorm.weight"], eps)
        gated = F.silu(h @ w[m + "gate_proj.weight"].T) * (h @ w[m + "up_proj.weight"].T)
        x = x + gated @ w[m + "down_proj.weight"].T
    return rms_norm(x, w["norm.weight"], eps)


def draft_block_logits(
    draft: Draft, target: PreTrainedModel, ctx_features: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """Logits [..., B-1, V] of block rows 1 .. B-1, for anchors [...] after ctx_features
    [..., p, n * H], through the target's embedding and the target's lm_head (a reduced
    vocabulary: the draft's own, over its V tokens)."""
    mask = torch.full((*anchors.shape, draft.block_size - 1), draft.mask_token_id)
    block = torch.cat([anchors[..., None], mask], dim=-1)
    hidden = draft_hidden(draft, ctx_features, target.model.embed_tokens.weight[block])
    head = draft.weights.get("lm_head.weight", target.lm_head.weight)
    return hidden[..., 1:, :] @ head.T


# ---- a round (dflash.md section 4, greedy) ----


def reference_generate(
    target_dir: Path | str,
    draft_dir: Path | str,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    width: int | None = None,
) -> tuple[list[int], list[RefRound]]:
    """Greedy DFlash generation: (generated ids without the prompt, every verify round). Each
    round verifies the anchor and the first width - 1 of the block's drafts (width: the block
    size unless given; the draft still runs its whole block, as the engine's does)."""
    target, draft = load_target(target_dir), read_draft(draft_dir)
    layer_ids, width = draft.target_layer_ids, width or draft.block_size
    logits, feats = target_pass(target, prompt_ids, layer_ids)
    out = [int(logits[-1].argmax())]
    rounds: list[RefRound] = []
    while out[-1] not in eos_ids and len(out) < max_new_tokens:
        seq = list(prompt_ids) + out
        p, anchor = len(seq) - 1, out[-1]
        with torch.no_grad():
            draft_logits = draft_block_logits(draft, target, feats[:p], torch.tensor(anchor))
        drafts = draft.target_ids(draft_logits.argmax(-1)).tolist()[: width - 1]
        # The verify pass's features cover p .. p+B-1; rows p .. p+acc are the next context.
        logits, feats = target_pass(target, seq + drafts, layer_ids)
        post = logits[p : p + width].argmax(-1).tolist()
        acc = 0
        while acc < width - 1 and drafts[acc] == post[acc]:
            acc += 1
        committed = _cut(post[: acc + 1], eos_ids, max_new_tokens - len(out))
        out += committed
        rounds.append(RefRound(p, anchor, drafts, committed))
    return out, rounds


def _cut(tokens: list[int], eos_ids: Sequence[int], room: int) -> list[int]:
    """Keep tokens up to and including the first eos, and at most room of them (by length)."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            tokens = tokens[: i + 1]
            break
    return tokens[:room]


def reference_drafts(
    target_dir: Path | str, draft_dir: Path | str, sequence: Sequence[int], positions: list[int]
) -> dict[int, list[int]]:
    """The reference's drafts d1 .. d_{B-1} for a block anchored at each of `positions` of a
    committed sequence. A block's drafts depend only on the tokens before its anchor and the
    anchor, so one target pass over the whole sequence serves every round, whatever width the
    engine verified."""
    target, draft = load_target(target_dir), read_draft(draft_dir)
    _, feats = target_pass(target, sequence, draft.target_layer_ids)
    drafts = {}
    for p in positions:
        with torch.no_grad():
            logits = draft_block_logits(draft, target, feats[:p], torch.tensor(sequence[p]))
        drafts[p] = draft.target_ids(logits.argmax(-1)).tolist()
    return drafts

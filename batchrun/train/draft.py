"""Train a DFlash drafter on its target's own completions (dflash.md and the DFlash paper).

    python -m batchrun.train.draft --target DIR --data PARQUET_OR_DIR [...] --out DIR
                                   [--block-size 16] [--layers 1] [--steps N] [--batch-size N]

The data is batchrun output (or any Parquet with `prompt` or `prompt_token_ids`, and
`completion_token_ids`); rows with an error are skipped. The target is frozen. Each training
sequence carries many anchors at random completion positions; for an anchor at p the block is
[token_p, MASK x (B-1)] at positions p .. p+B-1 and sees the context features of positions < p
and its own block only, all anchors in one forward through an attention mask. The loss is the
cross-entropy of block rows 1 .. B-1 through the target's lm_head against the target's tokens,
weighted by exp(-(j-1)/gamma) along the block. The result is a z-lab format draft directory.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from batchrun.engine.loading import resolve_device
from batchrun.io.reader import resolve_input_paths
from batchrun.models.dflash import default_target_layer_ids
from batchrun.tools.tiny_draft import draft_config, unused_embedding_row
from batchrun.train import (
    LossLog,
    autocast,
    environment,
    log,
    lr_factor,
    seed_everything,
    write_report,
)


@dataclass(frozen=True)
class DraftRun:
    block_size: int = 16
    num_layers: int = 1
    intermediate_size: int | None = None  # None: the target's
    steps: int = 3000
    batch_size: int = 32  # sequences per step
    anchors: int = 32  # blocks per sequence
    gamma: float = 7.0  # loss weight decay along the block (the paper's value for B = 16)
    lr: float = 1e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    max_len: int = 1024  # prompt + completion, cut to this
    eval_rows: int = 256  # held-out rows for the tau estimate
    seed: int = 0
    device: str = "auto"
    time_limit: float = 300.0  # seconds of training; a safety net, the steps should fit
    log_every: int = 50


@dataclass(frozen=True)
class TokenRow:
    ids: list[int]  # prompt + completion
    prompt_len: int


# ---- data ----


def read_rows(
    data: list[str], tokenizer: PreTrainedTokenizerBase, max_len: int
) -> tuple[list[TokenRow], dict[str, int]]:
    """Rows with a completion to learn from, and counts of what was read and skipped."""
    rows: list[TokenRow] = []
    counts = {"files": 0, "rows": 0, "error_rows": 0, "short_rows": 0}
    for spec in data:
        for path in resolve_input_paths(spec):
            counts["files"] += 1
            names = set(pq.read_schema(path).names)
            prompt = "prompt_token_ids" if "prompt_token_ids" in names else "prompt"
            if prompt not in names or "completion_token_ids" not in names:
                raise ValueError(
                    f"{path}: needs a prompt or prompt_token_ids, and a completion_token_ids column"
                )
            columns = [prompt, "completion_token_ids"] + (["error"] if "error" in names else [])
            for row in pq.read_table(path, columns=columns).to_pylist():
                counts["rows"] += 1
                if row.get("error") is not None or row["completion_token_ids"] is None:
                    counts["error_rows"] += 1
                    continue
                # Tokenized as batchrun tokenizes a text prompt.
                ids = row[prompt] if prompt == "prompt_token_ids" else tokenizer.encode(row[prompt])
                seq = (list(ids) + list(row["completion_token_ids"]))[:max_len]
                if len(seq) < len(ids) + 2:  # an anchor and at least one token to predict
                    counts["short_rows"] += 1
                    continue
                rows.append(TokenRow(seq, len(ids)))
    return rows, counts


def split_rows(
    rows: list[TokenRow], eval_rows: int, seed: int
) -> tuple[list[TokenRow], list[TokenRow]]:
    """(train, held-out): a seeded choice of at most a tenth of the rows is held out."""
    order = np.random.default_rng(seed).permutation(len(rows))
    n_eval = min(eval_rows, max(1, len(rows) // 10)) if len(rows) > 1 else 0
    return [rows[i] for i in order[n_eval:]], [rows[i] for i in order[:n_eval]]


def pad_rows(rows: list[TokenRow], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [N, T] right-padded, lengths [N], prompt lengths [N]."""
    width = max(len(r.ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r.ids)] = torch.tensor(r.ids)
    lens = torch.tensor([len(r.ids) for r in rows])
    return ids, lens, torch.tensor([r.prompt_len for r in rows])


def sample_anchors(
    prompt_lens: torch.Tensor, lens: torch.Tensor, count: int, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to count distinct anchors per row in [prompt_len, len - 2]: (positions, valid) [N, K]."""
    anchors = torch.zeros(len(lens), count, dtype=torch.long)
    valid = torch.zeros(len(lens), count, dtype=torch.bool)
    for i, (start, stop) in enumerate(zip(prompt_lens.tolist(), (lens - 1).tolist(), strict=True)):
        chosen = rng.choice(np.arange(start, stop), size=min(count, stop - start), replace=False)
        anchors[i, : len(chosen)] = torch.from_numpy(np.sort(chosen))
        valid[i, : len(chosen)] = True
    return anchors, valid


# ---- the frozen target ----


@contextmanager
def captured_layers(
    target: Qwen3ForCausalLM, layer_ids: list[int]
) -> Iterator[dict[int, torch.Tensor]]:
    """Capture each listed decoder layer's OUTPUT: HF's hidden_states[l + 1], but pre-norm also
    for the last layer, where HF's last hidden state has the final norm applied."""
    captured: dict[int, torch.Tensor] = {}

    def hook_for(layer_id: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    hooks = [target.model.layers[i].register_forward_hook(hook_for(i)) for i in set(layer_ids)]
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def target_features(
    target: Qwen3ForCausalLM, ids: torch.Tensor, layer_ids: list[int]
) -> torch.Tensor:
    """f = concat of the listed layers' outputs [N, T, n * H]. Right padding needs no mask:
    the target is causal, so padding changes no earlier position."""
    with captured_layers(target, layer_ids) as captured:
        target.model(input_ids=ids, use_cache=False)
    return torch.cat([captured[i] for i in layer_ids], dim=-1)


# ---- the draft ----


class TrainableDraft(nn.Module):
    """The draft's weights under the z-lab names (fc, hidden_norm, layers.i.*, norm), with a
    training forward that drafts many blocks per sequence at once."""

    def __init__(self, config: Qwen3Config, num_features: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.fc = nn.Linear(num_features * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(config)  # non-persistent buffers: not saved
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=config.initializer_range)

    def forward(
        self,
        features: torch.Tensor,  # [N, T, n * H] target features of every position
        block_embeds: torch.Tensor,  # [N, Q, H] target embeddings of [anchor, MASK, ...] per block
        block_positions: torch.Tensor,  # [N, Q]
        mask: torch.Tensor,  # [N, 1, Q, T + Q] bool, True where a block row may attend
    ) -> torch.Tensor:
        """The final-normed block rows [N, Q, H]."""
        n, t = features.shape[:2]
        ctx = self.hidden_norm(self.fc(features))
        ctx_positions = torch.arange(t, device=features.device).expand(n, t)
        ctx_rope = self.rotary(ctx, ctx_positions)
        blk_rope = self.rotary(block_embeds, block_positions)
        x = block_embeds
        for layer in self.layers:
            x = self._layer(cast(Qwen3DecoderLayer, layer), x, ctx, blk_rope, ctx_rope, mask)
        return self.norm(x)

    @staticmethod
    def _layer(
        layer: Qwen3DecoderLayer,
        x: torch.Tensor,
        ctx: torch.Tensor,
        blk_rope: tuple[torch.Tensor, torch.Tensor],
        ctx_rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """dflash.md section 3: context rows only feed this layer's k/v (norm then RoPE), with no
        layernorm, residual or MLP of their own; block rows are a normal pre-norm layer."""
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = _heads(attn.q_norm(_split(attn.q_proj(h), attn.head_dim)), blk_rope)
        k_blk = _heads(attn.k_norm(_split(attn.k_proj(h), attn.head_dim)), blk_rope)
        k_ctx = _heads(attn.k_norm(_split(attn.k_proj(ctx), attn.head_dim)), ctx_rope)
        v_blk = _split(attn.v_proj(h), attn.head_dim).transpose(1, 2)
        v_ctx = _split(attn.v_proj(ctx), attn.head_dim).transpose(1, 2)
        groups = attn.num_key_value_groups
        k = torch.cat([k_ctx, k_blk], dim=2).repeat_interleave(groups, dim=1)
        v = torch.cat([v_ctx, v_blk], dim=2).repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
        x = x + attn.o_proj(o.transpose(1, 2).flatten(2))
        return x + layer.mlp(layer.post_attention_layernorm(x))


def _split(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.view(*x.shape[:-1], -1, head_dim)


def _heads(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """[N, T, heads, d] -> RoPE (rotate-half) -> [N, heads, T, d]."""
    cos, sin = (c.unsqueeze(2) for c in rope)
    return (x * cos + rotate_half(x) * sin).transpose(1, 2)


def block_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """[N, 1, K*B, T + K*B]: block k's rows see context positions < p_k and block k only."""
    n, k = anchors.shape
    ctx_ok = torch.arange(context_len, device=anchors.device) < anchors[:, :, None]  # [N, K, T]
    block_of = torch.arange(k * block_size, device=anchors.device) // block_size
    same = block_of[:, None] == block_of[None, :]  # [KB, KB]
    rows = torch.cat([ctx_ok.repeat_interleave(block_size, dim=1), same.expand(n, -1, -1)], dim=2)
    return rows[:, None]


def draft_logits(
    draft: TrainableDraft,
    target: Qwen3ForCausalLM,
    features: torch.Tensor,
    ids: torch.Tensor,
    anchors: torch.Tensor,
    mask_id: int,
    block_size: int,
) -> torch.Tensor:
    """Logits [N, K, B-1, V] of rows 1 .. B-1 of every block, through the target's lm_head."""
    n, k = anchors.shape
    block = torch.full((n, k, block_size), mask_id, dtype=torch.long, device=ids.device)
    block[:, :, 0] = ids.gather(1, anchors)
    positions = anchors[:, :, None] + torch.arange(block_size, device=ids.device)
    embeds = target.model.embed_tokens(block.flatten(1))
    mask = block_attention_mask(anchors, features.shape[1], block_size)
    hidden = draft(features, embeds, positions.flatten(1), mask)
    rows = hidden.view(n, k, block_size, -1)[:, :, 1:]
    return target.lm_head(rows)


def block_labels(
    ids: torch.Tensor, lens: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's tokens at p+1 .. p+B-1 [N, K, B-1], and which of them exist."""
    positions = anchors[:, :, None] + torch.arange(1, width, device=ids.device)
    labels = ids.gather(1, positions.clamp(max=ids.shape[1] - 1).flatten(1)).view_as(positions)
    exists = (positions < lens[:, None, None]) & valid[:, :, None]
    return labels, exists


# ---- training and evaluation ----


@dataclass
class Setup:
    target: Qwen3ForCausalLM
    draft: TrainableDraft
    layer_ids: list[int]
    mask_id: int
    pad_id: int
    device: torch.device


def train_draft(setup: Setup, rows: list[TokenRow], run: DraftRun) -> tuple[LossLog, int, float]:
    """The training loop: (loss log, steps done, seconds). Stops early past run.time_limit."""
    rng = np.random.default_rng(run.seed)
    s, dev = setup, setup.device
    params = [p for p in s.draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params,
        lr=run.lr,
        betas=(0.9, 0.95),
        weight_decay=run.weight_decay,
        fused=dev.type == "cuda",
    )
    j = torch.arange(run.block_size - 1, dtype=torch.float32, device=dev)
    weights = torch.exp(-j / run.gamma)  # row j+1 of the block
    losses = LossLog(every=run.log_every)
    s.draft.train()
    start = time.monotonic()
    step = 0
    while step < run.steps and time.monotonic() - start < run.time_limit:
        for group in optimizer.param_groups:
            group["lr"] = run.lr * lr_factor(step, run.steps, run.warmup, run.min_lr_ratio)
        pick = rng.choice(len(rows), size=run.batch_size, replace=len(rows) < run.batch_size)
        ids, lens, prompt_lens = pad_rows([rows[i] for i in pick], s.pad_id)
        anchors, valid = sample_anchors(prompt_lens, lens, run.anchors, rng)
        ids, lens, anchors, valid = ids.to(dev), lens.to(dev), anchors.to(dev), valid.to(dev)
        with autocast(dev):
            features = target_features(s.target, ids, s.layer_ids)
            logits = draft_logits(
                s.draft, s.target, features, ids, anchors, s.mask_id, run.block_size
            )
        labels, exists = block_labels(ids, lens, anchors, valid, run.block_size)
        ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none")
        w = weights * exists
        loss = (ce.view_as(w) * w).sum() / w.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        point = losses.add(step, loss)
        step += 1
        if point is not None:
            log(f"draft step {step}/{run.steps} loss {point['loss']:.4f}")
    return losses, step, time.monotonic() - start


@torch.no_grad()
def estimate_tau(setup: Setup, rows: list[TokenRow], block_size: int) -> dict[str, Any]:
    """Greedy DFlash rounds replayed against the target's own tokens (dflash.md section 4).

    The first completion token comes from the prefill; each round anchors at the newest
    committed token, drafts B-1 tokens, accepts the leading ones that equal the target's and
    commits them plus the target's next token, cut at the completion's end. With greedy data,
    this is what batchrun would commit, up to numerics.
    """
    s = setup
    s.draft.eval()
    hist = torch.zeros(block_size, dtype=torch.long)
    for start in range(0, len(rows), 64):
        ids, lens, prompt_lens = pad_rows(rows[start : start + 64], s.pad_id)
        ids, lens, p = ids.to(s.device), lens.to(s.device), prompt_lens.to(s.device)
        with autocast(s.device):
            features = target_features(s.target, ids, s.layer_ids)
        active = p < lens - 1
        while bool(active.any()):
            anchors = p[:, None]
            with autocast(s.device):
                logits = draft_logits(
                    s.draft, s.target, features, ids, anchors, s.mask_id, block_size
                )
            labels, exists = block_labels(ids, lens, anchors, active[:, None], block_size)
            match = (logits.argmax(-1) == labels) & exists
            accepted = match[:, 0].long().cumprod(dim=-1).sum(dim=-1)
            committed = torch.minimum(accepted + 1, lens - 1 - p)
            hist += torch.bincount(committed[active].cpu() - 1, minlength=block_size)
            p = torch.where(active, p + committed, p)
            active = p < lens - 1
    s.draft.train()
    rounds = int(hist.sum())
    tokens = int((hist * torch.arange(1, block_size + 1)).sum())
    accepted_beyond = hist.flip(0).cumsum(0).flip(0)[1:]  # rounds committing more than j tokens
    return {
        "rows": len(rows),
        "rounds": rounds,
        "committed_tokens": tokens,
        "tau": tokens / rounds if rounds else None,
        "accept_hist": hist.tolist(),
        "per_position_acceptance": [round(float(c) / max(rounds, 1), 4) for c in accepted_beyond],
    }


# ---- checkpoint ----


def load_frozen_target(target_dir: Path, device: torch.device) -> Qwen3ForCausalLM:
    """The target in float32 (autocast computes in bf16 on CUDA), with no gradients."""
    target = Qwen3ForCausalLM.from_pretrained(
        str(target_dir), dtype=torch.float32, attn_implementation="sdpa"
    )
    return target.to(device).eval().requires_grad_(False)  # type: ignore[arg-type]


def draft_model_config(
    target: Qwen3ForCausalLM, num_layers: int, intermediate_size: int | None = None
) -> Qwen3Config:
    """The target's widths, norms and RoPE with the draft's own depth (and MLP width)."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    config.intermediate_size = intermediate_size or config.intermediate_size
    config.layer_types = ["full_attention"] * num_layers
    return config


def save_draft(
    draft: TrainableDraft,
    out: Path,
    target_dir: Path,
    run: DraftRun,
    layer_ids: list[int],
    mask_id: int,
) -> int:
    """config.json and model.safetensors in the z-lab format (dflash.md section 1), bfloat16;
    returns the weights' bytes."""
    out.mkdir(parents=True, exist_ok=True)
    target_config = json.loads((target_dir / "config.json").read_text())
    dflash = {"target_layer_ids": layer_ids, "mask_token_id": mask_id}
    config = draft_config(target_config, run.num_layers, run.block_size, dflash)
    config["dtype"] = "bfloat16"
    config["intermediate_size"] = run.intermediate_size or target_config["intermediate_size"]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = draft.state_dict()
    tensors = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in state.items()}
    path = out / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path.stat().st_size


def mask_token_for(target_dir: Path, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> int:
    """The first embedding row no token maps to (as Qwen3's 151669); the target must have one."""
    mask_id = unused_embedding_row(target_dir, vocab_size)
    if mask_id in set(tokenizer.get_vocab().values()):
        raise ValueError(
            f"{target_dir}: every embedding row is a token; the mask token needs a padded row "
            "(train the target with --padded-rows >= 1, or pass --mask-id)"
        )
    return mask_id


def run_draft(
    target_dir: Path,
    data: list[str],
    out: Path,
    run: DraftRun,
    layer_ids: list[int] | None = None,
    mask_id: int | None = None,
) -> dict[str, Any]:
    """Data, frozen target, training, tau estimate, checkpoint and report."""
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(run.device)
    seed_everything(run.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = load_frozen_target(target_dir, device)
    num_target_layers = target.config.num_hidden_layers
    if layer_ids is None:
        layer_ids = default_target_layer_ids(run.num_layers, num_target_layers)
    if not layer_ids or any(not 0 <= i < num_target_layers for i in layer_ids):
        raise ValueError(f"target_layer_ids {layer_ids} must be layers 0..{num_target_layers - 1}")
    vocab = target.config.vocab_size
    mask_id = mask_token_for(target_dir, tokenizer, vocab) if mask_id is None else mask_id
    if not 0 <= mask_id < vocab:
        raise ValueError(f"mask token {mask_id} is not a row of the target's embedding ({vocab})")

    max_len = min(run.max_len, target.config.max_position_embeddings)
    rows, counts = read_rows(data, tokenizer, max_len)
    train_rows, heldout_rows = split_rows(rows, run.eval_rows, run.seed)
    if not train_rows:
        raise ValueError(f"no usable rows in {data} (read: {counts})")
    log(f"draft data: {len(train_rows)} train rows, {len(heldout_rows)} held-out rows ({counts})")

    draft = TrainableDraft(
        draft_model_config(target, run.num_layers, run.intermediate_size), len(layer_ids)
    ).to(device)
    # Padding is never a label and never context of a live row: any real row will do.
    setup = Setup(target, draft, layer_ids, mask_id, pad_id=mask_id, device=device)
    losses, steps_done, seconds = train_draft(setup, train_rows, run)
    with torch.no_grad():  # measure what ships: the weights rounded to bfloat16
        for param in draft.parameters():
            param.copy_(param.to(torch.bfloat16))
    tau = estimate_tau(setup, heldout_rows, run.block_size) if heldout_rows else None
    if tau is not None:
        log(f"offline greedy tau {tau['tau']:.3f} over {tau['rounds']} rounds")
    weight_bytes = save_draft(draft, out, target_dir, run, layer_ids, mask_id)
    report = {
        "environment": environment(device),
        "target": str(target_dir),
        "data": {"paths": data, **counts, "train_rows": len(train_rows)},
        "draft": {
            "num_layers": run.num_layers,
            "block_size": run.block_size,
            "target_layer_ids": layer_ids,
            "mask_token_id": mask_id,
            "parameters": sum(p.numel() for p in draft.parameters()),
            "weights_bytes": weight_bytes,
        },
        "run": asdict(run),
        "steps_done": steps_done,
        "stopped_early": steps_done < run.steps,
        "train_seconds": round(seconds, 1),
        "train_loss": losses.summary(),
        "heldout_tau": tau,
    }
    write_report(out, report)
    return report


def main(argv: list[str] | None = None) -> None:
    r = DraftRun()
    parser = argparse.ArgumentParser(
        prog="python -m batchrun.train.draft",
        description="Train a DFlash drafter on a target's own completions (batchrun output).",
    )
    parser.add_argument("--target", type=Path, required=True, help="the target model directory")
    parser.add_argument(
        "--data", nargs="+", required=True, help="batchrun output dirs, Parquet files or globs"
    )
    parser.add_argument("--out", type=Path, required=True, help="draft directory to write")
    parser.add_argument("--block-size", type=int, default=r.block_size)
    parser.add_argument("--layers", type=int, default=r.num_layers, help="draft decoder layers")
    parser.add_argument(
        "--intermediate", type=int, default=None, help="draft MLP width (default: the target's)"
    )
    parser.add_argument(
        "--layer-ids", default=None, help="comma-separated target layer ids (default: derived)"
    )
    parser.add_argument("--mask-id", type=int, default=None, help="default: first padded row")
    parser.add_argument("--steps", type=int, default=r.steps)
    parser.add_argument("--batch-size", type=int, default=r.batch_size, help="sequences per step")
    parser.add_argument("--anchors", type=int, default=r.anchors, help="blocks per sequence")
    parser.add_argument("--gamma", type=float, default=r.gamma, help="loss decay along a block")
    parser.add_argument("--lr", type=float, default=r.lr)
    parser.add_argument("--warmup", type=int, default=r.warmup)
    parser.add_argument("--weight-decay", type=float, default=r.weight_decay)
    parser.add_argument("--max-len", type=int, default=r.max_len)
    parser.add_argument("--eval-rows", type=int, default=r.eval_rows)
    parser.add_argument("--seed", type=int, default=r.seed)
    parser.add_argument("--device", default=r.device, help="auto, cpu or cuda")
    parser.add_argument("--time-limit", type=float, default=r.time_limit, help="seconds")
    parser.add_argument("--log-every", type=int, default=r.log_every)
    a = parser.parse_args(argv)
    if a.block_size < 2:
        parser.error("--block-size must be >= 2")
    run = DraftRun(
        block_size=a.block_size,
        num_layers=a.layers,
        intermediate_size=a.intermediate,
        steps=a.steps,
        batch_size=a.batch_size,
        anchors=a.anchors,
        gamma=a.gamma,
        lr=a.lr,
        warmup=a.warmup,
        weight_decay=a.weight_decay,
        max_len=a.max_len,
        eval_rows=a.eval_rows,
        seed=a.seed,
        device=a.device,
        time_limit=a.time_limit,
        log_every=a.log_every,
    )
    layer_ids = [int(x) for x in a.layer_ids.split(",")] if a.layer_ids else None
    report = run_draft(a.target, a.data, a.out, run, layer_ids, a.mask_id)
    tau = (report["heldout_tau"] or {}).get("tau")
    log(f"wrote {a.out} ({report['draft']['weights_bytes'] / 1e6:.2f} MB); held-out tau {tau}")


if __name__ == "__main__":
    main()

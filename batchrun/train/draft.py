"""Train a DFlash drafter on its target's own completions (docs/dflash.md and the DFlash paper).

    python -m batchrun.train.draft --target DIR --data PARQUET_OR_DIR [...] --out DIR
                                   [--block-size 16] [--layers 2] [--steps N] [--batch-size N]

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
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen3ForCausalLM

from batchrun.device import resolve_device
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
from batchrun.train.draft_data import TokenRow, pad_rows, read_rows, sample_anchors, split_rows
from batchrun.train.draft_model import (
    TrainableDraft,
    block_labels,
    draft_logits,
    draft_model_config,
    load_frozen_target,
    target_features,
)


@dataclass(frozen=True)
class DraftRun:
    block_size: int = 16
    num_layers: int = 2  # one layer cannot both read the anchor and look it up in the context
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
    """Greedy DFlash rounds replayed against the target's own tokens (docs/dflash.md section 4).

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


def save_draft(
    draft: TrainableDraft,
    out: Path,
    target_dir: Path,
    run: DraftRun,
    layer_ids: list[int],
    mask_id: int,
) -> int:
    """config.json and model.safetensors in the z-lab format (docs/dflash.md section 1), bfloat16;
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

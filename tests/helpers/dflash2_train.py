"""Train a tiny DFlash2 drafter a little on CPU, as dflash_train.py trains DFlash's (the same
prompts, continuations and memorisation), so that it is accepted often but not always. The
training forward is the reference's own (dflash2_reference.block_logits), and the selector
learns with its backbone: the walk's score of the true next token among the row's top-K,
after the true previous token (teacher forcing), next to the head's cross-entropy."""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.helpers.dflash2_models import make_tiny_dflash2
from tests.helpers.dflash2_reference import block_logits, edges, read_draft2
from tests.helpers.dflash_reference import load_target, one_thread
from tests.helpers.dflash_train import (
    LEARNING_RATE,
    POSITION_DECAY,
    TRAIN_SEED,
    TRAINED_BLOCK_SIZE,
    TRAINED_LAYER_IDS,
    AnchorBatches,
    save_trained,
)

TRAIN_STEPS = 300


def train_dflash2(target_dir: Path | str, draft_dir: Path | str, *, steps: int, seed: int) -> Path:
    """Train the DFlash2 drafter in draft_dir in place; returns draft_dir."""
    target, draft = load_target(target_dir), read_draft2(draft_dir)
    width = draft.base.block_size
    data = AnchorBatches(target, draft.base.target_layer_ids, width, seed)
    rng = random.Random(seed)
    weights = draft.base.weights
    params = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in weights.items()}
    trainable = dataclasses.replace(draft, base=dataclasses.replace(draft.base, weights=params))
    optimizer = torch.optim.Adam(list(params.values()), lr=LEARNING_RATE)
    decay = POSITION_DECAY ** torch.arange(width - 1, dtype=torch.float32)
    with one_thread():
        for _ in range(steps):
            ctx, block = data.sample(rng)  # anchor, labels
            labels = block[:, 1:]
            logits, proj = block_logits(trainable, target, ctx, block[:, 0])
            head = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
            unary, candidates = logits.topk(draft.top_k, dim=-1)
            scores = unary + edges(trainable, block[:, :-1], proj, candidates)
            hit = candidates == labels[..., None]
            walk = torch.where(  # the true token's place among the candidates, when it is one
                hit.any(-1),
                F.cross_entropy(
                    scores.flatten(0, 1), hit.float().flatten(0, 1), reduction="none"
                ).view_as(labels),
                torch.zeros_like(labels, dtype=torch.float32),
            )
            per_row = head.view_as(labels) + walk
            loss = (per_row * decay).sum(-1).mean() / decay.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return save_trained(draft_dir, params)


def _start_as_dflash(draft_dir: Path) -> None:
    """Identity convolutions (tap 0 one, tap 1 and the dynamic part zero) and a silent selector
    (successor codebook zero): training starts from DFlash's drafter and the argmax walk, and
    learns what the two modules add."""
    file = draft_dir / "model.safetensors"
    weights = load_file(str(file))
    for name, tensor in weights.items():
        if name.endswith("base_kernel"):
            tensor.zero_()[:, 0] = 1.0
        elif name.endswith(("kernel_projection.weight", "successor_codebook")):
            tensor.zero_()
    save_file(weights, str(file))


def trained_dflash2_beside(target_dir: Path | str) -> Path:
    """The tests' trained DFlash2 drafter for target_dir, trained once a session in a sibling
    directory (under a temporary name, then renamed)."""
    target = Path(target_dir)
    out = target.with_name(f"{target.name}-dflash2-trained")
    if not out.exists():
        scratch = target.with_name(f"{target.name}-dflash2-training")
        shutil.rmtree(scratch, ignore_errors=True)
        make_tiny_dflash2(
            scratch,
            target,
            num_layers=1,
            block_size=TRAINED_BLOCK_SIZE,
            target_layer_ids=TRAINED_LAYER_IDS,
            seed=TRAIN_SEED,
        )
        _start_as_dflash(scratch)
        train_dflash2(target, scratch, steps=TRAIN_STEPS, seed=TRAIN_SEED)
        scratch.rename(out)
    return out

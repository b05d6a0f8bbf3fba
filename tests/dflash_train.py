"""Train a tiny DFlash draft for a few seconds on CPU so that it agrees with its target often,
but not always: acceptance lengths then vary between rounds, which exercises every commit path.

A random tiny target's continuations look like noise, so a tiny draft cannot learn them in
general; it memorises the target's greedy continuations of training_prompts(seed) instead.
Tests that want a good draft generate from those prompts. The training forward is the
reference's own (dflash_reference.draft_block_logits), so the trained function is exactly the
one the reference and the engine run.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from dflash_reference import (
    draft_block_logits,
    load_target,
    one_thread,
    read_draft,
    target_pass,
)
from transformers import Qwen3ForCausalLM

from batchrun.tools.tiny_draft import make_tiny_draft

NUM_PROMPTS = 8
PROMPT_LENGTHS = (2, 12)
PROMPT_IDS = (3, 1000)  # ordinary tokens of every tiny tokenizer (0-2 are special)
CONTINUATION = 40  # tests generate at most this many tokens from the training prompts
LEARNING_RATE = 1e-2
# Later block rows are harder and only count once the earlier ones are accepted: weigh them less.
POSITION_DECAY = 0.7


def training_prompts(seed: int) -> list[list[int]]:
    """The prompts whose continuations train_draft(..., seed=seed) memorises."""
    rng = random.Random(seed)
    return [
        [rng.randrange(*PROMPT_IDS) for _ in range(rng.randint(*PROMPT_LENGTHS))]
        for _ in range(NUM_PROMPTS)
    ]


def greedy_continuation(target: Qwen3ForCausalLM, prompt: list[int]) -> list[int]:
    """prompt + the target's greedy continuation, stopping after an eos."""
    eos = target.generation_config.eos_token_id
    with torch.no_grad():
        ids = target.generate(
            torch.tensor([prompt]),
            max_new_tokens=CONTINUATION,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    return ids[0].tolist()


def train_draft(target_dir: Path | str, draft_dir: Path | str, *, steps: int, seed: int) -> Path:
    """Train the draft in draft_dir (written by make_tiny_draft) in place; returns draft_dir."""
    target, draft = load_target(target_dir), read_draft(draft_dir)
    width, layer_ids = draft.block_size, draft.target_layer_ids
    prompts = training_prompts(seed)
    sequences = [greedy_continuation(target, prompt) for prompt in prompts]
    features = [target_pass(target, s, layer_ids)[1] for s in sequences]
    # Anchors where generation puts them: from the first generated token on. One step trains
    # every sequence at one anchor position p, so their contexts share a length and batch.
    by_position: dict[int, list[int]] = {}
    for i, (prompt, seq) in enumerate(zip(prompts, sequences, strict=True)):
        for p in range(len(prompt), len(seq) - width + 1):
            by_position.setdefault(p, []).append(i)
    positions = sorted(by_position)

    rng = random.Random(seed)
    params = {k: v.clone().requires_grad_(True) for k, v in draft.weights.items()}
    trainable = dataclasses.replace(draft, weights=params)
    optimizer = torch.optim.Adam(params.values(), lr=LEARNING_RATE)
    decay = POSITION_DECAY ** torch.arange(width - 1, dtype=torch.float32)
    with one_thread():
        for _ in range(steps):
            p = rng.choice(positions)
            rows = by_position[p]
            ctx = torch.stack([features[i][:p] for i in rows])
            anchors = torch.tensor([sequences[i][p] for i in rows])
            labels = torch.tensor([sequences[i][p + 1 : p + width] for i in rows])
            logits = draft_block_logits(trainable, target, ctx, anchors)
            per_row = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
            loss = (per_row.view(len(rows), -1) * decay).sum(-1).mean() / decay.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    config = json.loads((Path(draft_dir) / "config.json").read_text())
    explicit_ids = (config.get("dflash_config") or {}).get("target_layer_ids")
    return make_tiny_draft(
        draft_dir,
        target_dir,
        num_layers=draft.num_layers,
        block_size=width,
        target_layer_ids=explicit_ids,
        mask_token_id=draft.mask_token_id,
        state_dict={k: v.detach() for k, v in params.items()},
    )


# The trained draft the tests share: for a 4-layer target, block 4, features of layers 1 and 2.
TRAINED_LAYERS = 1
TRAINED_BLOCK_SIZE = 4
TRAINED_LAYER_IDS = [1, 2]
TRAIN_STEPS = 300
TRAIN_SEED = 0


def trained_draft_beside(target_dir: Path | str) -> Path:
    """The tests' trained draft for target_dir, kept in a sibling directory so that every test
    module of a session reuses one training run (trained under a temporary name, then renamed,
    so an interrupted run leaves nothing that looks finished)."""
    target = Path(target_dir)
    out = target.with_name(target.name + "-dflash-trained")
    if not out.exists():
        scratch = target.with_name(target.name + "-dflash-training")
        shutil.rmtree(scratch, ignore_errors=True)
        make_tiny_draft(
            scratch,
            target,
            num_layers=TRAINED_LAYERS,
            block_size=TRAINED_BLOCK_SIZE,
            target_layer_ids=TRAINED_LAYER_IDS,
            seed=TRAIN_SEED,
        )
        train_draft(target, scratch, steps=TRAIN_STEPS, seed=TRAIN_SEED)
        scratch.rename(out)
    return out

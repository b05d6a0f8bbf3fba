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
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from batchrun.tools.tiny_draft import make_tiny_draft
from tests.helpers.dflash_reference import (
    draft_block_logits,
    load_target,
    one_thread,
    read_draft,
    target_pass,
)

NUM_PROMPTS = 8
PROMPT_LENGTHS = (2, 12)
PROMPT_IDS = (3, 1000)  # ordinary tokens of every tiny tokenizer (0-2 are special)
CONTINUATION = 40  # tests generate at most this many tokens from the training prompts
LEARNING_RATE = 1e-2
# Later block rows are harder and only count once the earlier ones are accepted: weigh them less.
POSITION_DECAY = 0.7


def training_prompts(seed: int, ids: tuple[int, int] = PROMPT_IDS) -> list[list[int]]:
    """The prompts whose continuations train_draft(..., seed=seed, ids=ids) memorises (ids: the
    range their tokens come from, for a target whose vocabulary is smaller)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(*ids) for _ in range(rng.randint(*PROMPT_LENGTHS))]
        for _ in range(NUM_PROMPTS)
    ]


def greedy_continuation(target: PreTrainedModel, prompt: list[int]) -> list[int]:
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


def continuation_vocab(target_dir: Path | str, seed: int, size: int) -> list[int]:
    """A reduced draft vocabulary of `size` target ids that holds every token of the target's
    greedy continuations of training_prompts(seed), then the lowest other ids."""
    target = load_target(target_dir)
    seen = {t for p in training_prompts(seed) for t in greedy_continuation(target, p)}
    others = [i for i in range(target.config.vocab_size) if i not in seen]
    assert len(seen) <= size, (len(seen), size)
    return sorted(seen) + others[: size - len(seen)]


class AnchorBatches:
    """What a tiny drafter trains on: the target's greedy continuations of
    training_prompts(seed, ids), their target features, and the anchor positions where
    generation puts them (from the first generated token on). One batch holds every sequence
    at one anchor position, so their contexts share a length."""

    def __init__(
        self,
        target: PreTrainedModel,
        layer_ids: list[int],
        width: int,
        seed: int,
        ids: tuple[int, int] = PROMPT_IDS,
    ) -> None:
        prompts = training_prompts(seed, ids)
        self.width = width
        self.sequences = [greedy_continuation(target, prompt) for prompt in prompts]
        self.features = [target_pass(target, s, layer_ids)[1] for s in self.sequences]
        self.by_position: dict[int, list[int]] = {}
        for i, (prompt, seq) in enumerate(zip(prompts, self.sequences, strict=True)):
            for p in range(len(prompt), len(seq) - width + 1):
                self.by_position.setdefault(p, []).append(i)
        self.positions = sorted(self.by_position)

    def sample(self, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
        """(context features [rows, p, F], blocks [rows, width]: the anchor, then the labels)
        at a random anchor position p."""
        p = rng.choice(self.positions)
        rows = self.by_position[p]
        ctx = torch.stack([self.features[i][:p] for i in rows])
        return ctx, torch.tensor([self.sequences[i][p : p + self.width] for i in rows])


def save_trained(draft_dir: Path | str, params: dict[str, torch.Tensor]) -> Path:
    """The trained tensors over draft_dir's model.safetensors, each in its stored dtype."""
    file = Path(draft_dir) / "model.safetensors"
    stored = load_file(str(file))
    save_file({k: params[k].detach().to(v.dtype) for k, v in stored.items()}, str(file))
    return Path(draft_dir)


def train_draft(
    target_dir: Path | str,
    draft_dir: Path | str,
    *,
    steps: int,
    seed: int,
    ids: tuple[int, int] = PROMPT_IDS,
) -> Path:
    """Train the draft in draft_dir (written by make_tiny_draft, in either format) in place:
    its float tensors; a reduced vocabulary's maps stay. Returns draft_dir."""
    target, draft = load_target(target_dir), read_draft(draft_dir)
    data = AnchorBatches(target, draft.target_layer_ids, draft.block_size, seed, ids)
    # Labels in the draft's vocabulary (a reduced one: the draft id of each target id, -100
    # for those it lacks).
    to_draft = torch.full((target.config.vocab_size,), -100)
    head = draft.weights.get("lm_head.weight", target.lm_head.weight)
    drafted = draft.target_ids(torch.arange(head.shape[0]))
    to_draft[drafted] = torch.arange(len(drafted))
    rng = random.Random(seed)
    params = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in draft.weights.items()}
    trainable = dataclasses.replace(draft, weights=params)
    optimizer = torch.optim.Adam([v for v in params.values() if v.requires_grad], lr=LEARNING_RATE)
    decay = POSITION_DECAY ** torch.arange(draft.block_size - 1, dtype=torch.float32)
    with one_thread():
        for _ in range(steps):
            ctx, block = data.sample(rng)
            labels = to_draft[block[:, 1:]]
            logits = draft_block_logits(trainable, target, ctx, block[:, 0])
            per_row = F.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-100
            )
            loss = (per_row.view(len(block), -1) * decay).sum(-1).mean() / decay.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return save_trained(draft_dir, params)


# The target the DFlash tests share (conftest's `target` fixture).
TARGET_SHAPE = {"num_layers": 4, "vocab_size": 1088, "tie_word_embeddings": False}

# The trained draft the tests share: for a 4-layer target, block 4, features of layers 1 and 2.
TRAINED_LAYERS = 1
TRAINED_BLOCK_SIZE = 4
TRAINED_LAYER_IDS = [1, 2]
TRAIN_STEPS = 300
TRAIN_SEED = 0


# The trained variants beyond z-lab's format: make_tiny_draft's options for each (the reduced
# vocabulary is filled in from the target's continuations).
TRAINED_VARIANTS: dict[str, dict[str, Any]] = {
    "": {},
    # Two layers, the second sliding over 6 positions (causal in the block, as z-lab's are).
    "sliding": {"num_layers": 2, "sliding_window": 6, "sliding_layers": [1]},
    # The speculators format, 400 of the target's 1088 ids, the first layer sliding over 5.
    "speculators-vocab": {
        "num_layers": 2,
        "sliding_window": 5,
        "sliding_layers": [0],
        "speculators": True,
        "draft_vocab": 400,
    },
}


def trained_draft_beside(target_dir: Path | str, variant: str = "") -> Path:
    """The tests' trained draft for target_dir (of a TRAINED_VARIANTS kind), kept in a sibling
    directory so that every test module of a session reuses one training run (trained under a
    temporary name, then renamed, so an interrupted run leaves nothing that looks finished)."""
    target = Path(target_dir)
    suffix = f"-{variant}" if variant else ""
    out = target.with_name(f"{target.name}-dflash-trained{suffix}")
    if not out.exists():
        scratch = target.with_name(f"{target.name}-dflash-training{suffix}")
        shutil.rmtree(scratch, ignore_errors=True)
        options: dict[str, Any] = {"num_layers": TRAINED_LAYERS, **TRAINED_VARIANTS[variant]}
        if "draft_vocab" in options:
            options["draft_vocab"] = continuation_vocab(target, TRAIN_SEED, options["draft_vocab"])
        make_tiny_draft(
            scratch,
            target,
            block_size=TRAINED_BLOCK_SIZE,
            target_layer_ids=TRAINED_LAYER_IDS,
            seed=TRAIN_SEED,
            **options,
        )
        train_draft(target, scratch, steps=TRAIN_STEPS, seed=TRAIN_SEED)
        scratch.rename(out)
    return out

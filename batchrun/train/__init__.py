"""Training of the demo pair: a small Qwen3 code model on the stdlib and its DFlash drafter.

    python -m batchrun.train.target --out models/target
    python -m batchrun.train.prompts --tokenizer models/target --out jobs/demo/prompts.parquet
    python -m batchrun.train.prompts --tokenizer models/target --split train --count 8000 \
        --out data/draft-prompts.parquet
    batchrun run --input data/draft-prompts.parquet --target models/target --draft none \
        --max-tokens 256 --output data/draft-completions
    python -m batchrun.train.draft --target models/target --data data/draft-completions \
        --out models/draft

This module holds the few helpers both trainers share: learning-rate schedule, autocast, the
loss log and the report. Training needs only torch, transformers, tokenizers, safetensors,
pyarrow and numpy, so it runs on a bare GPU machine.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers


def autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on CUDA; plain float32 on CPU, where bf16 matmuls are slow."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_ratio at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


@dataclass
class LossLog:
    """Training losses averaged over windows of `every` steps: a curve short enough to report.

    Losses are summed on their device and read once per window, so the GPU is not made to wait
    for the host every step.
    """

    every: int
    curve: list[dict[str, float]] = field(default_factory=list)
    _sum: torch.Tensor | None = None
    _count: int = 0

    def add(self, step: int, loss: torch.Tensor) -> dict[str, float] | None:
        """Record one step's loss; returns the window's point when a window closes."""
        loss = loss.detach().float()
        self._sum = loss if self._sum is None else self._sum + loss
        self._count += 1
        if (step + 1) % self.every:
            return None
        point = {"step": step + 1, "loss": round(float(self._sum) / self._count, 5)}
        self.curve.append(point)
        self._sum, self._count = None, 0
        return point

    def summary(self) -> dict[str, Any]:
        losses = [p["loss"] for p in self.curve]
        return {
            "first": losses[0] if losses else None,
            "last": losses[-1] if losses else None,
            "min": min(losses) if losses else None,
            "every_steps": self.every,
            "curve": self.curve,
        }


def environment(device: torch.device) -> dict[str, Any]:
    """What a result depends on besides the seed: the stdlib corpus is per interpreter."""
    return {
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "stdlib": sysconfig.get_paths()["stdlib"],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }


def write_report(out_dir: Path, report: dict[str, Any]) -> Path:
    path = out_dir / "train_report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)

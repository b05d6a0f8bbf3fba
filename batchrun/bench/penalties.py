"""What the penalties cost: steady decode steps at a real model's shape (random weights), each
batch size timed without penalties and with presence, frequency and repetition penalties on
every row, in one run on one engine (`batchrun bench --shape S --penalties`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from batchrun.bench.shapes import random_target
from batchrun.bench.steady import start_decoding
from batchrun.bench.sweep import time_steps
from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.startup import Models
from batchrun.models.qwen3 import Qwen3Shape

PENALIZED = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2}


def bench_penalties(
    shape_name: str,
    shape: Qwen3Shape,
    batch_sizes: tuple[int, ...],
    context: int,
    steps: int,
    dtype: torch.dtype,
    device: torch.device,
    cuda_graphs: bool,
) -> dict[str, Any]:
    model = random_target(shape, dtype, device)
    max_len = context + 4 * steps + 64
    config = EngineConfig(
        target=Path(f"random-{shape_name}"),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        cuda_graphs=cuda_graphs,
        max_batch_size=max(batch_sizes),
        max_batched_tokens=max(8192, max(batch_sizes)),
        max_model_len=max_len,
    )
    pages = max(batch_sizes) * (-(-max_len // config.page_size) + 2)
    engine = Engine(config, models=Models(model, None), num_pages=pages)
    points = []
    for batch in batch_sizes:
        point: dict[str, Any] = {"batch": batch, "context": context}
        for name, controls in (("plain", {}), ("penalties", PENALIZED)):
            reqs = start_decoding(engine, batch, context, **controls)
            point[f"{name}_ms_per_step"] = time_steps(engine, reqs, steps)["ms_per_step"]
            engine.abort_all()
        point["ratio"] = point["penalties_ms_per_step"] / point["plain_ms_per_step"]
        points.append(point)
        print(point, flush=True)
    return {
        "setup": {
            "shape_name": shape_name,
            "dtype": str(dtype),
            "device": str(device),
            "cuda_graphs": cuda_graphs,
            "steps": steps,
            "penalties": PENALIZED,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        },
        "points": points,
        "ratios": {f"batch_{p['batch']}_penalties_vs_plain": p["ratio"] for p in points},
    }

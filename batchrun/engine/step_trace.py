"""A record of every step a job reads back, kept when a benchmark asks (engine/instruments.py):
its kind, widest verify width, requests, rows, whether it replayed a CUDA graph and its pipeline
period. With the step timer's GPU times beside it, a summary by kind and width says whether a
step's period is the device's time (GPU-bound) or the host's, and which steps ran eagerly."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import fmean
from typing import Any


@dataclass(frozen=True)
class StepRecord:
    kind: str  # prefill, mixed or decode
    width: int  # the widest decoding request's rows
    requests: int  # live requests
    rows: int  # the forward's rows (a graph step's padded ones)
    replayed: bool  # the target's forward replayed a CUDA graph
    seconds: float  # its pipeline period (engine/step_times.py)


def summarize(
    records: list[StepRecord], draft_ms: list[float], target_ms: list[float]
) -> dict[str, dict[str, float]]:
    """By "kind width": steps, mean and longest period, requests and rows, the share replayed
    and, where the timer ran (a GPU: one time per step launched, in step order; the last one
    launched may be unread), the mean GPU milliseconds of the draft and of the target with its
    sampling."""
    timed = bool(records) and len(draft_ms) >= len(records)
    groups: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(records):
        groups[f"{r.kind} {r.width}"].append(i)
    out: dict[str, dict[str, Any]] = {}
    for key, idx in sorted(groups.items()):
        rs = [records[i] for i in idx]
        out[key] = {
            "steps": len(rs),
            "period_ms": 1e3 * fmean(r.seconds for r in rs),
            "max_period_ms": 1e3 * max(r.seconds for r in rs),  # a one-off stall stands out
            "requests": fmean(r.requests for r in rs),
            "rows": fmean(r.rows for r in rs),
            "replayed": fmean(r.replayed for r in rs),
        }
        if timed:
            out[key]["draft_gpu_ms"] = fmean(draft_ms[i] for i in idx)
            out[key]["target_gpu_ms"] = fmean(target_ms[i] for i in idx)
    return out

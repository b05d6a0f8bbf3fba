"""`batchrun stats`: a polars summary computed from the part files of an output directory, so it
works on a running job too. (polars is needed only here, not to run jobs.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from batchrun.errors import JobError
from batchrun.io.parts import PART_PATTERN
from batchrun.io.progress import SUCCESS_FILE
from batchrun.stats import STATS_COLUMNS, per_position_acceptance


def summarize(out_dir: Path, top_errors: int = 5) -> str:
    """A human summary of the part files in out_dir (works while the job is still running)."""
    parts = sorted(out_dir.glob(PART_PATTERN))
    if not parts:
        raise JobError(f"no part files in {str(out_dir)!r}")
    frame = (
        pl.scan_parquet(parts)
        .select(STATS_COLUMNS)
        .with_columns(pl.col(pl.Int32).cast(pl.Int64))  # polars sums int32 in int32: it wraps
        .collect()
    )
    ok = frame.filter(pl.col("finish_reason") != "error")
    lines = [
        f"output: {out_dir} ({len(parts)} parts"
        + (", complete)" if (out_dir / SUCCESS_FILE).exists() else ", not complete)"),
        f"rows: {frame.height} ({ok.height} ok, {frame.height - ok.height} errors)",
        "finish reasons: "
        + ", ".join(
            f"{row['finish_reason']} {row['len']}"
            for row in frame.group_by("finish_reason")
            .len()
            .sort("len", descending=True)
            .iter_rows(named=True)
        ),
        f"prompt tokens: {ok['prompt_tokens'].sum()}, "
        f"completion tokens: {ok['completion_tokens'].sum()}",
    ]
    lines += _speculation_lines(ok)
    errors = (
        frame.filter(pl.col("error").is_not_null())
        .group_by("error")
        .len()
        .sort(["len", "error"], descending=[True, False])
        .head(top_errors)
    )
    if errors.height:
        lines.append("most common errors:")
        lines += [f"  {row['len']:>8}  {row['error']}" for row in errors.iter_rows(named=True)]
    return "\n".join(lines)


def _speculation_lines(ok: pl.DataFrame) -> list[str]:
    spec = ok.filter(pl.col("spec_accept_hist").is_not_null())
    if spec.height == 0:
        return ["speculation: none (no draft)"]
    flat = spec.select(pl.col("spec_accept_hist").explode()).to_series().to_numpy()
    hist = flat.astype(np.int64).reshape(spec.height, -1).sum(axis=0)
    rounds = int(spec["spec_rounds"].sum())
    tau = (int(spec["completion_tokens"].sum()) - spec.height) / rounds if rounds else None
    positions = per_position_acceptance(hist)
    return [
        f"speculation: block size {len(hist)}, {rounds} rounds, "
        f"acceptance length (tau) {f'{tau:.3f}' if tau is not None else 'n/a'}",
        "per-position acceptance: "
        + (" ".join(f"{p:.3f}" for p in positions) if positions is not None else "n/a"),
    ]

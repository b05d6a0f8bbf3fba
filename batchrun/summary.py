"""`batchrun stats`: a polars summary computed from the part files of an output directory, so it
works on a running job too. (polars is needed only here and in `batchrun report`, not to run jobs.)

Every shard and every run of a job writes its parts into the one directory; a summary merges them
all, counting the rows a run counts as done: those of readable parts of the job recorded in
_progress/job.json (parts of a job since overwritten, and damaged parts, are left out), each
(row_index, sample_index) once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from batchrun.errors import JobError
from batchrun.io.progress import SUCCESS_FILE, OutputDir
from batchrun.stats import STATS_COLUMNS, per_position_acceptance


@dataclass(frozen=True)
class CommittedParts:
    """The parts whose rows count, and how many other part files the directory holds."""

    out: OutputDir
    parts: list[Path]
    left_out: int  # damaged, or of another job

    @classmethod
    def of(cls, out_dir: Path) -> CommittedParts:
        out = OutputDir(out_dir)
        out.use_recorded_job()
        parts = out.committed_parts()
        if not parts:
            raise JobError(f"no part files in {str(out_dir)!r}")
        return cls(out, parts, len(out.all_parts()) - len(parts))

    def scan(self, columns: list[str]) -> pl.LazyFrame:
        """Their rows, each (row_index, sample_index) once (the first part by name holding it),
        with `part` (the part's path). int32 columns come as int64: polars sums int32 in int32,
        which wraps."""
        return (
            pl.scan_parquet(self.parts, include_file_paths="part")
            .select(["row_index", "sample_index", *columns, "part"])
            .unique(subset=["row_index", "sample_index"], keep="first", maintain_order=True)
            .with_columns(pl.col(pl.Int32).cast(pl.Int64))
        )


def summarize(out_dir: Path, top_errors: int = 5) -> str:
    """A human summary of the part files in out_dir (works while the job is still running)."""
    committed = CommittedParts.of(out_dir)
    frame = committed.scan(STATS_COLUMNS).collect()
    ok = frame.filter(pl.col("finish_reason") != "error")
    left_out = f", {committed.left_out} left out" if committed.left_out else ""
    lines = [
        f"output: {out_dir} ({len(committed.parts)} parts{left_out}"
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


def pooled_hist(ok: pl.DataFrame) -> np.ndarray | None:
    """The spec_accept_hist of the rows that have one, summed; None without a draft."""
    spec = ok.filter(pl.col("spec_accept_hist").is_not_null())
    if spec.height == 0:
        return None
    flat = spec.select(pl.col("spec_accept_hist").explode()).to_series().to_numpy()
    hist: np.ndarray = flat.astype(np.int64).reshape(spec.height, -1).sum(axis=0)
    return hist


def _speculation_lines(ok: pl.DataFrame) -> list[str]:
    hist = pooled_hist(ok)
    if hist is None:
        return ["speculation: none (no draft)"]
    spec = ok.filter(pl.col("spec_accept_hist").is_not_null())
    rounds = int(spec["spec_rounds"].sum())
    tau = (int(spec["completion_tokens"].sum()) - spec.height) / rounds if rounds else None
    positions = per_position_acceptance(hist)
    return [
        f"speculation: block size {len(hist)}, {rounds} rounds, "
        f"acceptance length (tau) {f'{tau:.3f}' if tau is not None else 'n/a'}",
        "per-position acceptance: "
        + (" ".join(f"{p:.3f}" for p in positions) if positions is not None else "n/a"),
    ]

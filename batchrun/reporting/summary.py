"""`batchrun stats`: a polars summary computed from the part files of an output directory, so it
works on a running job too. (polars is needed only here and in `batchrun report`, not to run jobs.)

Every shard and every run of a job writes its parts into the one directory; a summary merges them
all, counting the rows a run counts as done: those of readable parts of the job recorded in
_progress/job.json (parts of a job since overwritten, and damaged parts, are left out), each
(row_index, sample_index) once. A part file batchrun did not write (no batchrun job key in its
Parquet metadata) is left out with a warning on stderr; a part whose columns are not batchrun's
output columns makes a one-line error.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path, PurePath

import numpy as np
import polars as pl
import pyarrow as pa

from batchrun.engine.core.requests import round_tokens
from batchrun.errors import JobError
from batchrun.io.output.columns import output_fields
from batchrun.io.output.directory import OutputDir
from batchrun.io.output.stats import (
    OPTIONAL_STATS_COLUMNS,
    STATS_COLUMNS,
    conditional_acceptance,
    full_block_tau,
    per_position_acceptance,
)

# Each output column's polars type as scan() gives it (int32 widened).
_OUTPUT_TYPES = dict(
    pl.DataFrame(pa.schema(output_fields()).empty_table())
    .with_columns(pl.col(pl.Int32).cast(pl.Int64))
    .schema
)


@dataclass(frozen=True)
class CommittedParts:
    """The parts whose rows count, and how many other part files the directory holds."""

    out: OutputDir
    parts: list[PurePath]
    left_out: int  # damaged, or of another job

    @classmethod
    def of(cls, out_dir: str | Path) -> CommittedParts:
        """The parts of a local output directory or an object-store output (s3://...)."""
        out = OutputDir.at(str(out_dir))
        out.use_recorded_job()
        parts, left_out = out.committed_parts(), len(out.all_parts())
        foreign = [part.name for part in out.foreign_parts()]
        if foreign:
            print(
                f"batchrun: warning: {len(foreign)} part file(s) not written by batchrun left "
                f"out: {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}",
                file=sys.stderr,
            )
        if not parts:
            why = f" ({left_out} left out: damaged, or of another job)" if left_out else ""
            raise JobError(f"no part files of the job in {out.shown!r}{why}")
        return cls(out, parts, left_out - len(parts))

    def read(self, columns: list[str]) -> pl.DataFrame:
        """scan(columns), collected; JobError if the parts do not hold batchrun's columns."""
        try:
            frame = self.scan(columns).collect()
        except (pl.exceptions.PolarsError, OSError) as exc:
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise JobError(f"cannot read the parts of {str(self.out.path)!r}: {why}") from exc
        wrong = [name for name in columns if frame.schema[name] != _OUTPUT_TYPES.get(name)]
        if wrong:
            raise JobError(
                f"the parts of {str(self.out.path)!r} are not batchrun's: column {wrong[0]!r} "
                f"is {frame.schema[wrong[0]]}, not {_OUTPUT_TYPES.get(wrong[0])}"
            )
        return frame

    def optional_columns(self) -> list[str]:
        """OPTIONAL_STATS_COLUMNS that every part has (parts of earlier versions lack them)."""
        schemas = [self.out.read_schema(part).names for part in self.parts]
        return [c for c in OPTIONAL_STATS_COLUMNS if all(c in names for names in schemas)]

    def scan(self, columns: list[str]) -> pl.LazyFrame:
        """Their rows, each (row_index, sample_index) once (the first part by name holding it),
        with `part` (the part's path, or its URI: polars reads object storage itself, configured
        by the same AWS_* environment). int32 columns come as int64: polars sums int32 in int32,
        which wraps."""
        sources = [self.out.store.shown(part) for part in self.parts]
        return (
            # Parts may differ by raw-bytes columns (invalid UTF-8 kept apart).
            pl.scan_parquet(sources, include_file_paths="part", extra_columns="ignore")
            .select(["row_index", "sample_index", *columns, "part"])
            .unique(subset=["row_index", "sample_index"], keep="first", maintain_order=True)
            .with_columns(pl.col(pl.Int32).cast(pl.Int64))
        )


def summarize(out_dir: str | Path, top_errors: int = 5) -> str:
    """A human summary of the part files in out_dir (works while the job is still running)."""
    committed = CommittedParts.of(out_dir)
    frame = committed.read(STATS_COLUMNS + committed.optional_columns())
    ok = frame.filter(pl.col("finish_reason") != "error")
    left_out = f", {committed.left_out} left out" if committed.left_out else ""
    lines = [
        f"output: {out_dir} ({len(committed.parts)} parts{left_out}"
        + (", complete)" if committed.out.complete() else ", not complete)"),
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


def pooled_hist(ok: pl.DataFrame, column: str = "spec_accept_hist") -> np.ndarray | None:
    """The histogram column of the rows that have one, summed; None without a draft."""
    if column not in ok.columns:
        return None
    spec = ok.filter(pl.col(column).is_not_null())
    if spec.height == 0:
        return None
    flat = spec.select(pl.col(column).explode()).to_series().to_numpy()
    hist: np.ndarray = flat.astype(np.int64).reshape(spec.height, -1).sum(axis=0)
    return hist


def _speculation_lines(ok: pl.DataFrame) -> list[str]:
    """Tau over the rounds that drafted (what the width policy got), and the drafter's own
    full-block tau, estimated from each draft's acceptance given the ones before."""
    hist = pooled_hist(ok)
    if hist is None:
        return ["speculation: none (no draft)"]
    rounds = int(hist.sum())
    tau = round_tokens(hist) / rounds if rounds else None
    capped = pooled_hist(ok, "spec_capped_hist")
    conditional = conditional_acceptance(hist, capped if capped is not None else 0 * hist)
    drafter = full_block_tau(conditional)
    positions = per_position_acceptance(hist)
    return [
        f"speculation: block size {len(hist)}, {rounds} rounds, "
        f"acceptance length (tau) {_number(tau)}; "
        f"the drafter's at the full block {_number(drafter)}",
        "per-position acceptance: "
        + (" ".join(f"{p:.3f}" for p in positions) if positions is not None else "n/a"),
    ]


def _number(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "n/a"

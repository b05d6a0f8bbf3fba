"""`batchrun report`: one self-contained HTML page over an output directory.

A header table, then plotly figures: throughput over time, the acceptance length (tau) across
rows, per-position acceptance, completion lengths and error rows by kind. The rows are those
`batchrun stats` counts (every shard and run merged, each row once). plotly.js is inlined once,
so the page opens without a network. plotly comes with the extra `batchrun[report]`.

Throughput comes from the parts' manifests in _progress/: each says when its part's run started
generating and when the part was written, and the part's tokens are taken as generated evenly
between its run's previous part (or start) and itself. Tokens count when their row finishes, so
a job that is one batch shows little until its rows end. A part whose manifest does not say
(rebuilt after a kill, or older, or one batchrun could not have written) falls back to its
file's mtime. The page replaces OUT/report.html atomically, and never through a symlink.
"""

from __future__ import annotations

import contextlib
import html
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import groupby
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from batchrun.errors import JobError
from batchrun.io.output.directory import STATS_FILE, OutputDir
from batchrun.io.output.stats import per_position_acceptance
from batchrun.io.parts import PROGRESS_DIR, REPORT_FILE
from batchrun.reporting.summary import CommittedParts, pooled_hist

COLUMNS = [
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "spec_rounds",
    "spec_accept_hist",
    "acceptance_length",
    "error",
]
TITLES = {  # plot div id: its heading
    "throughput": "Throughput over time",
    "tau": "Acceptance length (tau) across rows",
    "acceptance": "Per-position acceptance",
    "completion-length": "Completion length",
    "errors": "Error rows by kind",
}
THROUGHPUT_BINS = 40
_SHARD = re.compile(r"part-(\d+)-of-(\d+)-\d+\.parquet")
_STYLE = (
    "body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;padding:0 1em}"
    "table{border-collapse:collapse}th,td{text-align:left;padding:3px 14px 3px 0;"
    "border-bottom:1px solid #ddd}th{font-weight:600}.note{color:#555}"
)


def _plotly() -> Any:
    try:
        import plotly.graph_objects as go
    except ImportError:
        raise JobError("batchrun report needs plotly: pip install 'batchrun[report]'") from None
    return go


@dataclass(frozen=True)
class _Run:
    """The parts one run (of one shard) wrote: when each was written and its ok rows' completion
    tokens, in order."""

    shard: str
    started: float | None  # when it started generating; None for parts that do not say
    written: list[float]
    tokens: list[int]

    @property
    def times(self) -> list[float]:
        """Its start (else its first part's time), then each part's: part i's tokens were
        generated between times[i] and times[i + 1]."""
        return [self.written[0] if self.started is None else self.started, *self.written]

    @property
    def label(self) -> str:
        started = self.started
        return self.shard + (f", run from {_utc(started):%H:%M:%S}" if started is not None else "")


def write_report(out_dir: str | Path, html_path: Path | None = None) -> str:
    """Write the report (by default OUT/report.html, also in object storage); returns where."""
    go = _plotly()
    committed = CommittedParts.of(out_dir)
    out = committed.out
    rows = committed.read(COLUMNS)
    ok = rows.filter(pl.col("finish_reason") != "error")
    info = _job_info(out)
    runs = _runs(committed, ok)
    sections: list[tuple[str, Any]] = [("throughput", _throughput(go, runs))]
    hist = pooled_hist(ok)
    if hist is None and info.get("draft") is None:
        sections.append(
            ("", "No draft model: the speculation plots (tau, acceptance) are left out.")
        )
    else:
        sections += [("tau", _tau(go, ok)), ("acceptance", _acceptance(go, hist))]
    sections += [("completion-length", _lengths(go, ok)), ("errors", _errors(go, rows))]
    page = _page(out.shown, _header(out, committed, rows, ok, info, runs), sections)
    try:
        if html_path is None:  # in the output directory: never through a symlink
            out.store.write_text(out.path / REPORT_FILE, page)
            return out.store.shown(out.path / REPORT_FILE)
        html_path.write_text(page)  # a file the user named
    except OSError as exc:
        where = html_path or out.store.shown(out.path / REPORT_FILE)
        raise JobError(f"cannot write {str(where)!r}: {exc.strerror or exc}") from exc
    return str(html_path)


def _page(out_dir: str, header: str, sections: list[tuple[str, Any]]) -> str:
    """The HTML page: sections are (plot div id, a figure or a note), or ("", a note)."""
    body = [f"<h1>batchrun report: {html.escape(out_dir)}</h1>", header]
    first_figure = True
    for div_id, content in sections:
        if div_id:
            body.append(f"<h2>{TITLES[div_id]}</h2>")
        if isinstance(content, str):
            body.append(f'<p class="note">{html.escape(content)}</p>')
            continue
        content.update_layout(
            height=380, margin={"t": 20, "b": 50}, showlegend=len(content.data) > 1
        )
        body.append(
            content.to_html(
                full_html=False,
                include_plotlyjs=first_figure,  # inlined once, in the first figure
                div_id=div_id,
                config={"displaylogo": False},
            )
        )
        first_figure = False
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>batchrun report: {html.escape(out_dir.rstrip('/').rsplit('/', 1)[-1])}</title>"
        f"<style>{_STYLE}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def _job_info(out: OutputDir) -> dict[str, Any]:
    """stats.json, or while shards still run the newest shard's own stats (files that do not
    hold a JSON object are skipped)."""
    shards = []
    for path in out.store.glob(out.path / PROGRESS_DIR, "stats-*.json"):
        with contextlib.suppress(OSError):
            shards.append((out.store.stat(path)[1], path))
    for path in [out.path / STATS_FILE, *(path for _, path in sorted(shards, reverse=True))]:
        try:
            info = json.loads(out.store.read_text(path))
        except (OSError, ValueError):
            continue
        if isinstance(info, dict):
            return info
    return {}


def _runs(committed: CommittedParts, ok: pl.DataFrame) -> list[_Run]:
    """The committed parts grouped by the run that wrote them (shard and start time)."""
    tokens = dict(ok.group_by("part").agg(pl.col("completion_tokens").sum()).iter_rows())
    parts = []
    for path in committed.parts:
        shard = _SHARD.fullmatch(path.name)
        label = f"shard {int(shard[1])}/{int(shard[2])}" if shard else "all rows"
        started, written = committed.out.part_times(path)
        parts.append((label, started, written, int(tokens.get(committed.out.store.shown(path), 0))))
    parts.sort(key=lambda p: (p[0], p[1] or 0.0, p[2]))
    return [
        _Run(shard, started, [p[2] for p in group], [p[3] for p in group])
        for (shard, started), grouped in groupby(parts, key=lambda p: (p[0], p[1]))
        if (group := list(grouped))
    ]


def _generation_seconds(runs: list[_Run]) -> float | None:
    """The time at least one run was generating: the union of the runs' spans (shards side by
    side count once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted((run.times[0], run.times[-1]) for run in runs):
        total += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total if total > 0 else None


def _utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC).replace(tzinfo=None)


def _throughput(go: Any, runs: list[_Run], bins: int = THROUGHPUT_BINS) -> Any:
    """Completion tokens/s in equal slices of time, stacked by run."""
    start = min(run.times[0] for run in runs)
    width = (max(run.times[-1] for run in runs) - start) / bins
    if width <= 0:
        return "Too few timed parts to plot (parts written before batchrun recorded their times)."
    edges = start + width * np.arange(bins + 1)
    x = [_utc(t) for t in edges[:-1] + width / 2]
    fig = go.Figure()
    for run in runs:
        per_bin = np.zeros(bins)
        times = run.times
        for since, until, tokens in zip(times[:-1], times[1:], run.tokens, strict=True):
            if until > since:  # spread evenly over the slices [since, until] overlaps
                overlap = np.minimum(edges[1:], until) - np.maximum(edges[:-1], since)
                per_bin += tokens * np.clip(overlap, 0, None) / (until - since)
        fig.add_trace(go.Bar(x=x, y=per_bin / width, name=run.label))
    return fig.update_layout(
        barmode="stack", bargap=0, xaxis_title="time (UTC)", yaxis_title="completion tokens/s"
    )


def _tau(go: Any, ok: pl.DataFrame) -> Any:
    tau = ok["acceptance_length"].drop_nulls()
    if tau.len() == 0:
        return "No row reached a verify round."
    fig = go.Figure(go.Histogram(x=tau.to_list(), marker_color="#4c78a8"))
    return fig.update_layout(xaxis_title="acceptance length (tau)", yaxis_title="rows")


def _acceptance(go: Any, hist: Any) -> Any:
    positions = per_position_acceptance(hist) if hist is not None else None
    if positions is None:
        return "No verify rounds."
    fig = go.Figure(go.Bar(x=list(range(1, len(hist))), y=positions, marker_color="#4c78a8"))
    return fig.update_layout(
        xaxis_title="draft position j",
        yaxis_title="share of rounds accepting draft j",
        yaxis_range=[0, 1],
    )


def _lengths(go: Any, ok: pl.DataFrame) -> Any:
    if ok.height == 0:
        return "No ok rows."
    fig = go.Figure(go.Histogram(x=ok["completion_tokens"].to_list(), marker_color="#4c78a8"))
    return fig.update_layout(xaxis_title="completion tokens", yaxis_title="rows")


def _errors(go: Any, rows: pl.DataFrame) -> Any:
    """Error rows grouped by the message before its first colon, numbers as N."""
    kinds = (
        rows.filter(pl.col("error").is_not_null())
        .select(
            kind=pl.col("error")
            .str.split(":")
            .list.first()
            .str.replace_all(r"\d+", "N")
            .str.strip_chars()
        )
        .group_by("kind")
        .len()
        .sort(["len", "kind"], descending=[True, False])
    )
    if kinds.height == 0:
        return "No error rows."
    counts = kinds["len"].to_list()
    bars = go.Bar(x=counts, y=kinds["kind"].to_list(), orientation="h", marker_color="#e45756")
    fig = go.Figure(bars).update_layout(xaxis_title="rows", yaxis_autorange="reversed")
    return fig.update_xaxes(dtick=1) if max(counts) <= 10 else fig  # whole rows


def _header(
    out: OutputDir,
    committed: CommittedParts,
    rows: pl.DataFrame,
    ok: pl.DataFrame,
    info: dict[str, Any],
    runs: list[_Run],
) -> str:
    seconds = _generation_seconds(runs)
    tokens = int(ok["completion_tokens"].sum())
    of_input = (
        f" of {info['input_rows']}" if info.get("shard") is None and "input_rows" in info else ""
    )
    complete = "complete" if out.complete() else "not complete"
    left_out = f"; {committed.left_out} left out (damaged or another job's)"
    table = {
        "rows": f"{rows.height}{of_input} ({complete})",
        "ok / error rows": f"{ok.height} / {rows.height - ok.height}",
        "prompt / completion tokens": f"{int(ok['prompt_tokens'].sum())} / {tokens}",
        "generation time": f"{seconds:.1f} s" if seconds else None,
        "completion tokens/s": f"{tokens / seconds:.1f}" if seconds else None,
        "wall time, last run (stats.json)": info.get("wall_seconds"),
        "model": info.get("target"),
        "draft": info.get("draft") or "none",
        "dtype": info.get("dtype"),
        "device": info.get("device"),
        "attention backend": info.get("attention_backend"),
        "parts": f"{len(committed.parts)} from {len({run.shard for run in runs})} shard(s) "
        f"in {len(runs)} run(s)" + (left_out if committed.left_out else ""),
    }
    cells = "".join(
        f"<tr><th>{html.escape(key)}</th><td>{html.escape(_cell(value))}</td></tr>"
        for key, value in table.items()
    )
    return f'<table id="summary">{cells}</table>'


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1f} s" if isinstance(value, float) else str(value)

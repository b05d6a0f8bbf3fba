"""The renderers of `batchrun.bench.tables`: each turns loaded result files into a Markdown
table. Every cell comes from the files; a run, point or workload present in a file is always
shown, so a table cannot leave out the runs that went badly."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from typing import Any

from batchrun.bench.ratios import BEST, no_draft_run, speed_ratios

Result = dict[str, Any]
MISSING = "—"


def markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _ordered(names: Iterable[str]) -> list[str]:
    """Distinct names in order of first appearance."""
    return list(dict.fromkeys(names))


def _per_file(
    results: dict[str, Result], rows_of: Callable[[Result], list[list[str]]]
) -> list[list[str]]:
    """Each file's rows in manifest order; with several files a first column names the file."""
    several = len(results) > 1
    return [
        [f"`{path.rsplit('/', 1)[-1]}`", *row] if several else row
        for path, result in results.items()
        for row in rows_of(result)
    ]


# --- `batchrun bench --jobs` ---------------------------------------------------------------


def jobs(results: dict[str, Result]) -> list[str]:
    """One row per workload, a column per run in the files (all of them): the no-draft run as
    tokens/s with its fraction of the job's bound, every other run as its ratio to it."""
    workloads = [w for r in results.values() for w in r["workloads"].values()]
    runs = _ordered(name for w in workloads for name in w["runs"])
    generate = any("hf_generate" in w for w in workloads)
    header = ["workload"] + [
        "`none`: tok/s (of its bound)" if name == "none" else f"`{name}` / `none`" for name in runs
    ]
    header += ["`none` / generate() (its tok/s)"] if generate else []

    def rows_of(result: Result) -> list[list[str]]:
        rows = []
        for name, entry in result["workloads"].items():
            base = entry["runs"].get("none", {}).get("tokens_per_second")
            row = [name] + [_job_cell(entry["runs"].get(run), run, base) for run in runs]
            if generate:
                hf = entry.get("hf_generate", {}).get("tokens_per_second")
                row.append(f"{base / hf:.2f}x ({hf:,.0f})" if hf and base else MISSING)
            rows.append(row)
        return rows

    if len(results) > 1:
        header.insert(0, "file")
    return markdown(header, _per_file(results, rows_of))


def _job_cell(run: dict[str, Any] | None, name: str, base: float | None) -> str:
    if run is None:
        return MISSING
    tps = run["tokens_per_second"]
    if name == "none" or not base:  # a ratio needs the no-draft run; else the rate itself
        bound = run.get("fraction_of_bound")
        return f"{tps:,.0f}" + (f" ({bound:.0%})" if bound is not None else "")
    return f"{tps / base:.2f}x"


# The width policy's contract: `auto` at least this share of the best of no draft and the
# full block, in every scenario.
POLICY_FLOOR = 0.97


def policy(results: dict[str, Result]) -> list[str]:
    """The width policy against its contract: one row per workload and drafter scenario that
    ran under both `auto` and `full` (useless, the oracle at each tau, each changing
    scenario), `auto` and `full` against no draft on the same rows (bench/ratios.py), `auto`
    against the better of the two."""

    def rows_of(result: Result) -> list[list[str]]:
        rows = []
        for name, entry in result["workloads"].items():
            speeds = {n: run["tokens_per_second"] for n, run in entry["runs"].items()}
            ratios = speed_ratios(speeds)
            scenarios = _ordered(r[: -len(" auto")] for r in speeds if r.endswith(" auto"))
            for scenario in scenarios:
                auto, full = f"{scenario} auto", f"{scenario} full"
                share = ratios.get(f"{auto} / {BEST}")
                if share is None:  # no full-block run (or no no-draft run) beside it
                    continue
                rows.append(
                    [
                        name,
                        scenario,
                        f"{speeds[no_draft_run(auto, speeds)]:,.0f}",
                        f"{ratios[f'{auto} / none']:.3f}",
                        f"{ratios[f'{full} / none']:.3f}",
                        f"{share:.3f}" + ("" if share >= POLICY_FLOOR else " (missed)"),
                    ]
                )
        return rows

    header = [
        "workload",
        "drafter",
        "`none` tok/s",
        "`auto` / `none`",
        "`full` / `none`",
        f"`auto` / best of the two (>= {POLICY_FLOOR})",
    ]
    if len(results) > 1:
        header.insert(0, "file")
    return markdown(header, _per_file(results, rows_of))


# --- `batchrun bench --shape` sweeps ---------------------------------------------------------


def steady(results: dict[str, Result]) -> list[str]:
    """One row per (series, batch, context) of the sweep's summary. The DFlash columns follow the
    file's layout: a round's time and projections at each tau (older sweeps), or a round's time
    at each verify width and the adaptive width's projection at each acceptance profile."""
    series = {
        (path, label): rows
        for path, result in results.items()
        for label, rows in _series(result).items()
    }
    summary = [row for rows in series.values() for row in rows]
    generate = _ordered(k for row in summary for k in row if k.startswith("vs_generate_"))
    taus = _ordered(t for row in summary for t in row.get("dflash_vs_target_only_at_tau", {}))
    widths = sorted({int(w) for row in summary for w in row.get("dflash_round_ms_by_width", {})})
    profiles = _ordered(p for row in summary for p in row.get("dflash", {}))
    rollback = sorted({int(w) for row in summary for w in row.get("rollback_share_by_width", {})})
    header = ["batch, context", "ms per decode step", "share of memory roofline"]
    header += [
        f"vs generate() {k.removeprefix('vs_generate_').replace('_', ' ')}" for k in generate
    ]
    one_round = any("dflash_round_ms" in r for r in summary)  # older sweeps: one width
    header += ["DFlash round, ms"] if one_round else []
    header += [f"DFlash at tau {float(t):g} vs target-only" for t in taus]
    if widths:
        header.append("DFlash round ms at W = " + " / ".join(map(str, widths)))
    header += [f"{_profile(p)}: adaptive W, vs target-only, vs full" for p in profiles]
    if rollback:  # a hybrid's: its linear states replayed over the kept rows
        header.append("rollback, % of a round at W = " + " / ".join(map(str, rollback)))
    several_files = len(results) > 1
    several_series = any(len(_series(r)) > 1 for r in results.values())
    rows = []
    for (path, label), summary_rows in series.items():
        lead = [f"`{path.rsplit('/', 1)[-1]}`"] if several_files else []
        lead += [label] if several_series else []
        for r in summary_rows:
            row = lead + [
                f"{r['batch']}, {r['context']:,}",
                f"{r['target_only_ms_per_token_step']:.2f}",
            ]
            row.append(_number(r.get("fraction_of_memory_roofline"), "{:.2f}"))
            row += [_number(r.get(k), "{:.1f}x") for k in generate]
            if one_round:
                row.append(_number(r.get("dflash_round_ms"), "{:.2f}"))
            at_tau = r.get("dflash_vs_target_only_at_tau", {})
            row += [_number(at_tau.get(t), "{:.2f}x") for t in taus]
            if widths:
                by_width = r.get("dflash_round_ms_by_width", {})
                row.append(" / ".join(_number(by_width.get(str(w)), "{:.1f}") for w in widths))
            row += [_adaptive(r.get("dflash", {}).get(p)) for p in profiles]
            if rollback:
                share = r.get("rollback_share_by_width", {})
                row.append(" / ".join(_percent(share.get(str(w))) for w in rollback))
            rows.append(row)
    header = (["file"] if several_files else []) + (["series"] if several_series else []) + header
    return markdown(header, rows)


def _series(result: Result) -> dict[str, list[dict[str, Any]]]:
    """A sweep's summaries by attention backend and KV dtype (older files: one, unnamed)."""
    return result.get("summary_by_backend") or {"": result["summary"]}


def _profile(name: str) -> str:
    return name if name.startswith("tau ") else f"at `{name}`'s acceptance"


def _adaptive(p: dict[str, Any] | None) -> str:
    if p is None:
        return MISSING
    return (
        f"{p['adaptive_width']}, {p['adaptive_vs_target_only']:.2f}x,"
        f" {p['adaptive_vs_full_width']:.2f}x"
    )


def _percent(share: float | None) -> str:
    return MISSING if share is None else f"{100 * share:.1f}"


def _number(value: float | None, form: str) -> str:
    return MISSING if value is None else form.format(value)


# --- bf16 against FP8 -----------------------------------------------------------------------


def fp8(pairs: list[dict[str, Any]]) -> list[str]:
    """Per pair of files (or of series in files), every point or job run of either side: the
    bf16 figure, the FP8 one and FP8's tokens/s against bf16's (the same batch on both sides,
    so a step's ratio is bf16's time over FP8's)."""
    rows = []
    for pair in pairs:
        bf16, fp8_side = pair.get("bf16"), pair["fp8"]
        shape = fp8_side["result"]["setup"]
        what = f"{shape['shape_name']}, {shape['shape']['num_layers']} layers"
        figures_bf16 = _pair_figures(bf16) if bf16 else {}
        figures_fp8 = _pair_figures(fp8_side)
        for key in _ordered([*figures_bf16, *figures_fp8]):
            a, b = figures_bf16.get(key), figures_fp8.get(key)
            ratio = MISSING
            if a and b:
                ratio = f"{(a[1] / b[1] if a[0] == 'ms' else b[1] / a[1]):.2f}x the tokens/s"
            rows.append([what, pair["what"], key, _figure(a), _figure(b), ratio])
    return markdown(["shape", "FP8", "figure", "bf16", "FP8", "FP8 / bf16"], rows)


def _pair_figures(side: dict[str, Any]) -> dict[str, tuple[str, float]]:
    """figure name -> (unit, value): a sweep's steps in ms, a jobs file's runs in tokens/s."""
    result, label = side["result"], side.get("series")
    if "workloads" in result:
        return {
            f"job {w}" + ("" if run == "none" else f", `{run}`"): ("tok/s", r["tokens_per_second"])
            for w, entry in result["workloads"].items()
            for run, r in entry["runs"].items()
        }
    series = _series(result)
    rows = series[label] if label else next(iter(series.values()))
    return {
        f"decode step, batch {r['batch']}, context {r['context']:,}": (
            "ms",
            r["target_only_ms_per_token_step"],
        )
        for r in rows
    }


def _figure(figure: tuple[str, float] | None) -> str:
    if figure is None:
        return "not measured"
    unit, value = figure
    return f"{value:.2f} ms" if unit == "ms" else f"{value:,.0f} tok/s"


# --- the demo job with and without its drafter -----------------------------------------------


def demo(pairs: list[dict[str, Any]]) -> list[str]:
    """Per pair of stats.json files (same job, with and without the drafter): wall times."""
    rows = []
    for pair in pairs:
        draft, plain = pair["draft"]["result"], pair["nodraft"]["result"]
        rows.append(
            [
                f"{draft['device']}, {draft['dtype']}",
                f"{draft['wall_seconds']:.1f} s",
                f"{plain['wall_seconds']:.1f} s",
                f"{plain['wall_seconds'] / draft['wall_seconds']:.2f}",
                _number(draft["acceptance_length"], "{:.2f}"),
            ]
        )
    header = ["device, dtype", "with the drafter", "without", "ratio (without / with)", "tau"]
    return markdown(header, rows)


# --- `batchrun bench --demo-policy` -------------------------------------------------------


def demo_policy(results: dict[str, Result]) -> list[str]:
    """One row per demo job: each mode's median tokens/s (every timed run beside it) and the
    ratios of `auto`."""

    def rows_of(result: Result) -> list[list[str]]:
        rows = []
        for name, entry in result["jobs"].items():
            cells = []
            for mode in ("none", "auto", "full"):
                run = entry["runs"].get(mode)
                runs = ", ".join(f"{r:,.0f}" for r in run["tokens_per_second_runs"]) if run else ""
                cells.append(f"{run['tokens_per_second']:,.0f} ({runs})" if run else MISSING)
            ratios, by_round = entry.get("ratios", {}), entry.get("ratios_by_round", {})
            for key in ("auto / none", "auto / best of none and full"):
                cells.append(_number(ratios.get(key), "{:.2f}x"))
                rounds = by_round.get(key)
                cells.append(
                    f"{statistics.median(rounds):.2f}x ({min(rounds):.2f}-{max(rounds):.2f})"
                    if rounds
                    else MISSING
                )
            rows.append([name, *cells])
        return rows

    header = [
        "job",
        "no draft, tok/s (runs)",
        "`auto`",
        "`full`",
        "auto / none",
        "by round: median (range)",
        "auto / best",
        "by round: median (range)",
    ]
    several = len(results) > 1
    return markdown((["file"] if several else []) + header, _per_file(results, rows_of))


# --- the replay's cost model fitted to a `bench --jobs` file ---------------------------------


def replay_fit(results: dict[str, Result]) -> list[str]:
    """One fit to the table's files (one call's: fitted.one_call): the fitted parameters, then
    each ratio beside the replay's, then each run's mean step of each kind timed and its whole
    job, measured and replayed (ms)."""
    from batchrun.bench.replay.fitted import fit_file, one_call  # the replay runs the scheduler

    fit = fit_file(one_call(list(results.values())))
    params = fit.costs.parameters()
    lines = markdown(["parameter", "fitted"], [[f"`{k}`", f"{v:.4g}"] for k, v in params.items()])
    rows = [
        [w, f"`{key}`", f"{m:.3f}", f"{r:.3f}", f"{r / m - 1:+.1%}"]
        for (w, key), (m, r) in fit.ratios.items()
    ]
    lines += ["", *markdown(["workload", "ratio", "measured", "replayed", "off"], rows)]
    kinds = _ordered(what for _, _, what in fit.residuals)
    runs = list(dict.fromkeys((w, run) for w, run, _ in fit.residuals))
    cells = [
        [w, f"`{run}`"]
        + [
            f"{m:,.1f} / {r:,.1f}" if (m, r) != (0, 0) else MISSING
            for m, r in (fit.residuals.get((w, run, k), (0, 0)) for k in kinds)
        ]
        for w, run in runs
    ]
    header = ["workload", "run", *[f"{k}: measured / replayed ms" for k in kinds]]
    return [*lines, "", *markdown(header, cells)]


FILE_KINDS: dict[str, Callable[[dict[str, Result]], list[str]]] = {
    "jobs": jobs,
    "policy": policy,
    "replay-fit": replay_fit,
    "steady": steady,
    "demo-policy": demo_policy,
}
PAIR_KINDS: dict[str, Callable[[list[dict[str, Any]]], list[str]]] = {"fp8": fp8, "demo": demo}

"""How a `bench --jobs` file's runs are compared: each against the no-draft run of the same
rows ("none"; "json" for a constrained workload's "json ..." runs, its rows under their
schemas), an adaptive width ("... auto") also against the better of that and its full block
("... full"). The job benchmark, the published tables and the fitted replay all read it here."""

from __future__ import annotations

from collections.abc import Container

BEST = "best of none and full"  # the width policy's contract: auto against this


def no_draft_run(name: str, runs: Container[str]) -> str:
    """The run that `name` is measured against: the same rows without a draft."""
    return "json" if name.startswith("json ") and "json" in runs else "none"


def full_block_run(name: str) -> str | None:
    """The full-block run an adaptive one ("<drafter> auto") is held against (None: not one)."""
    return name[: -len("auto")] + "full" if name.split(" ")[-1] == "auto" else None


def speed_ratios(speeds: dict[str, float]) -> dict[str, float]:
    """run name -> tokens/s, to "<run> / none" (against its no-draft run) and "<run> / best of
    none and full" (an adaptive run with its full-block run beside it)."""
    ratios: dict[str, float] = {}
    for name, speed in speeds.items():
        base = speeds.get(no_draft_run(name, speeds)) if name != "none" else None
        if not base:
            continue
        ratios[f"{name} / none"] = speed / base
        full = speeds.get(full_block_run(name) or "")
        if full:
            ratios[f"{name} / {BEST}"] = speed / max(base, full)
    return ratios

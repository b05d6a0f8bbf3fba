"""Job statistics: the content of stats.json, accumulated as parts commit."""

from __future__ import annotations

import platform
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import batchrun
from batchrun.engine.core.requests import round_tokens

# The output columns statistics are computed from.
STATS_COLUMNS = [
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "spec_rounds",
    "spec_accept_hist",
    "error",
]
OPTIONAL_STATS_COLUMNS = ["spec_capped_hist"]  # absent from parts of earlier versions


@dataclass(frozen=True)
class Timing:
    """Seconds of a run: wall covers all of it, load the start-up before the engine was ready
    (checks and model loading), generation the rest."""

    wall_seconds: float
    load_seconds: float
    generation_seconds: float

    @classmethod
    def of(cls, stats: dict[str, Any]) -> Timing:
        """The timing recorded in a stats.json."""
        return cls(stats["wall_seconds"], stats["load_seconds"], stats["generation_seconds"])

    @classmethod
    def longest(cls, timings: list[Timing]) -> Timing:
        """Of runs side by side (shards): each figure's maximum."""
        return cls(
            max((t.wall_seconds for t in timings), default=0.0),
            max((t.load_seconds for t in timings), default=0.0),
            max((t.generation_seconds for t in timings), default=0.0),
        )


class RunClock:
    """Times one run from its start; `engine_ready()` ends loading and starts generation."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.ready: float | None = None

    def engine_ready(self) -> None:
        self.ready = time.monotonic()

    def timing(self) -> Timing:
        now = time.monotonic()
        ready = self.ready if self.ready is not None else now
        return Timing(now - self.started, ready - self.started, now - ready)


def per_position_acceptance(hist: np.ndarray) -> list[float] | None:
    """Entry j-1: the fraction of rounds that committed more than j tokens (draft j accepted)."""
    rounds = int(hist.sum())
    if rounds == 0:
        return None
    return [float(hist[j:].sum() / rounds) for j in range(1, len(hist))]


def conditional_acceptance(hist: np.ndarray, capped: np.ndarray) -> list[float | None]:
    """Entry j-1: the chance that draft j is accepted once drafts 1 .. j-1 were, over the
    rounds that verified it (None where none did), under any mix of verify widths. A round
    committing k tokens accepted drafts 1 .. k-1, and verified draft k unless its width was k
    (capped: it accepted all it verified)."""
    out: list[float | None] = []
    for j in range(1, len(hist)):
        hits = int(hist[j:].sum())
        trials = hits + int(hist[j - 1] - capped[j - 1])
        out.append(hits / trials if trials else None)
    return out


def full_block_tau(conditional: list[float | None]) -> float | None:
    """Tokens a round verifying the whole block would commit at these chances: the drafter's
    own tau, whatever widths the job ran. None when draft 1 was never verified; a position
    never verified ends the estimate there (a lower bound)."""
    if not conditional or conditional[0] is None:
        return None
    tau, run = 1.0, 1.0
    for p in conditional:
        if p is None:
            break
        run *= p
        tau += run
    return tau


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {
        "batchrun": batchrun.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


class StatsAccumulator:
    """Running totals over output rows; token counts cover ok rows only."""

    def __init__(self) -> None:
        self.rows = 0
        self.error_rows = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.spec_rounds = 0
        self.hist: np.ndarray | None = None  # pooled spec_accept_hist
        self.capped: np.ndarray | None = None  # pooled spec_capped_hist
        self.finish_reasons: Counter[str] = Counter()

    def add(self, table: pa.Table) -> None:
        """Count the rows of a part (any table holding STATS_COLUMNS)."""
        ok = table.filter(pc.not_equal(table.column("finish_reason"), "error"))
        self.rows += table.num_rows
        self.error_rows += table.num_rows - ok.num_rows
        self.prompt_tokens += _sum(ok.column("prompt_tokens"))
        self.completion_tokens += _sum(ok.column("completion_tokens"))
        self.spec_rounds += _sum(ok.column("spec_rounds"))
        for reason, count in Counter(table.column("finish_reason").to_pylist()).items():
            self.finish_reasons[reason] += count
        spec = ok.filter(pc.is_valid(ok.column("spec_accept_hist")))
        if spec.num_rows:
            hist = _pooled(spec.column("spec_accept_hist"))
            self.hist = hist if self.hist is None else self.hist + hist
            # Parts written before spec_capped_hist existed: no round counts as capped.
            capped = np.zeros_like(hist)
            if "spec_capped_hist" in spec.column_names:  # null rows: none capped
                capped = _pooled(spec.column("spec_capped_hist"), len(hist))
            self.capped = capped if self.capped is None else self.capped + capped

    @property
    def spec_tokens(self) -> int:
        """Tokens the speculation rounds committed."""
        if self.hist is None:
            return 0
        return round_tokens(self.hist)

    def to_dict(
        self,
        *,
        info: dict[str, Any],
        block_size: int | None,
        timing: Timing,
        run_completion_tokens: int,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """stats.json. Throughput counts this run's tokens over this run's generation time."""
        uses_draft = block_size is not None or self.hist is not None
        tau = self.spec_tokens / self.spec_rounds if uses_draft and self.spec_rounds else None
        conditional = None
        if self.hist is not None and self.capped is not None:
            conditional = conditional_acceptance(self.hist, self.capped)
        return {
            "rows": self.rows,
            "ok_rows": self.rows - self.error_rows,
            "error_rows": self.error_rows,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "wall_seconds": round(timing.wall_seconds, 3),
            "load_seconds": round(timing.load_seconds, 3),
            "generation_seconds": round(timing.generation_seconds, 3),
            "output_tokens_per_second": (
                round(run_completion_tokens / timing.generation_seconds, 2)
                if timing.generation_seconds > 0
                else None
            ),
            "spec_rounds": self.spec_rounds,
            "acceptance_length": tau,  # over the rounds that drafted: the policy's yield
            "per_position_acceptance": (
                per_position_acceptance(self.hist) if self.hist is not None else None
            ),
            "conditional_acceptance": conditional,
            "drafter_acceptance_length": full_block_tau(conditional or []),
            "tokens_per_target_forward": info.get("tokens_per_target_forward"),
            "block_size": block_size if block_size is not None else _hist_len(self.hist),
            "target": info.get("target"),
            "draft": info.get("draft"),
            "dtype": info.get("dtype"),
            "device": info.get("device"),
            "tensor_parallel": info.get("tensor_parallel", 1),  # processes the target spans
            "attention_backend": info.get("attention_backend"),
            "attention_backend_ms": info.get("attention_backend_ms"),
            "kv_cache_dtype": info.get("kv_cache_dtype"),  # the target's KV pools'
            "verify_width_steps": info.get("verify_width_steps"),
            "steps": info.get("steps"),  # this run's steps by kind: prefill, mixed, decode
            "step_seconds": info.get("step_seconds"),  # and the seconds they took
            "width_seconds": info.get("width_seconds"),  # by kind and width: [steps, seconds]
            "draft_seconds": info.get("draft_seconds"),  # the draft's own, by width
            "startup_seconds": info.get("startup_seconds"),  # the engine's, by stage
            # Requests in flight, and whether start-up chose them (max_batch_size unset).
            "max_batch_size": info.get("max_batch_size"),
            "max_batch_size_chosen": info.get("max_batch_size_chosen"),
            # Whether prefix caching ran: off when asked, and with prompt logprobs.
            "prefix_caching": info.get("prefix_caching"),
            "prefix_cache_hit_rate": info.get("prefix_cache_hit_rate"),
            # Prompt tokens the target computed: cached prefixes and shared samples' are not.
            "prompt_tokens_computed": info.get("prompt_tokens_computed"),
            "versions": versions(),
            "finish_reasons": dict(sorted(self.finish_reasons.items())),
            **(extra or {}),
        }


def _pooled(column: pa.ChunkedArray, width: int | None = None) -> np.ndarray:
    """The sum over rows of a column of equal-length int lists; with `width`, a null row counts
    as `width` zeros (a row whose histogram exists may lack spec_capped_hist)."""
    filled = column.fill_null(pa.scalar([0] * width, column.type)) if width else column
    flat = pc.list_flatten(filled).to_numpy().astype(np.int64)
    return flat.reshape(len(column), -1).sum(axis=0)


def _sum(column: pa.ChunkedArray) -> int:
    total = pc.sum(column).as_py()
    return int(total) if total is not None else 0


def _hist_len(hist: np.ndarray | None) -> int | None:
    return len(hist) if hist is not None else None

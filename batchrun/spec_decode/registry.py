"""The speculation methods batchrun runs, one entry each (spec_decode/method.py's interface), and
the choice of a job's: the one its `speculative_method` names, or under `auto` the one whose
`architectures` the draft's config.json names. Start-up, preflight and memory sizing reach a
draft only through these functions."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from batchrun.errors import JobError
from batchrun.models.loader import read_config
from batchrun.models.qwen3 import Qwen3ForCausalLM, Qwen3Shape
from batchrun.parallel.group import TensorParallel
from batchrun.spec_decode.base import Speculator, TargetView
from batchrun.spec_decode.dflash.method import DFLASH
from batchrun.spec_decode.dflash2.method import DFLASH2
from batchrun.spec_decode.method import CheckedDraft, DraftBackends, DraftLayout, SpeculationMethod

AUTO = "auto"  # speculative_method's default: chosen by the draft's config.json

METHODS: dict[str, SpeculationMethod] = {
    DFLASH.name: DFLASH,
    DFLASH2.name: DFLASH2,
}


def choose_method(draft_dir: Path, asked: str = AUTO) -> SpeculationMethod:
    """The method named by `asked`, or under `auto` the one that claims the draft's
    `architectures`. Raises JobError."""
    if asked != AUTO:
        method = METHODS.get(asked)
        if method is None:
            raise JobError(
                f"speculative_method {asked!r} is not one of: {AUTO}, {', '.join(METHODS)}"
            )
        return method
    named = read_config(draft_dir, "draft").get("architectures")
    names = set(named) if isinstance(named, list) else set()
    claiming = [m for m in METHODS.values() if names & m.architectures]
    if len(claiming) == 1:
        return claiming[0]
    known = "; ".join(f"{m.name}: {', '.join(sorted(m.architectures))}" for m in METHODS.values())
    raise JobError(
        f"draft: architectures {named} is not supported: no speculation method, or more than "
        f"one, runs it (speculative_method {AUTO} chooses by architectures: {known})"
    )


def check_draft(draft_dir: Path, asked: str, target: Qwen3Shape) -> CheckedDraft:
    """The draft checked against its target by its method, reading no weights (preflight)."""
    method = choose_method(draft_dir, asked)
    spec = method.check(draft_dir, target)
    return CheckedDraft(method, draft_dir, spec, method.layout(spec))


def load_draft(
    draft_dir: Path,
    asked: str,
    target: Qwen3ForCausalLM,
    device: torch.device,
    max_positions: int,
) -> nn.Module:
    """The draft on `device`, loaded by its method."""
    return choose_method(draft_dir, asked).load(draft_dir, target, device, max_positions)


def method_of(draft: nn.Module) -> SpeculationMethod:
    """The method a loaded draft belongs to."""
    for method in METHODS.values():
        if method.owns(draft):
            return method
    raise TypeError(f"no speculation method runs a {type(draft).__name__}")


def draft_layout(draft: nn.Module | None) -> DraftLayout | None:
    """A loaded draft's layout (None without a draft)."""
    return method_of(draft).layout(draft) if draft is not None else None


def make_speculator(
    target: TargetView,
    *,
    draft: nn.Module | None,
    backends: DraftBackends,
    widths: tuple[int, ...],
    max_batch_size: int,
    tp: TensorParallel | None = None,
) -> Speculator:
    """The speculator over `target`: the draft's method's, plain decoding without a draft."""
    if draft is None:
        return Speculator()
    method = method_of(draft)
    return method.make(target, draft, backends, widths=widths, max_batch_size=max_batch_size, tp=tp)

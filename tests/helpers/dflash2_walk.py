"""A DFlash2 walk case as the walk tests build it: a dict of WalkInputs' fields (which a test
edits by name) with the rows' uniforms, or their seed and first_step."""

from __future__ import annotations

import torch

from batchrun.spec_decode.dflash2.walk import Walk, WalkInputs, walk, walk_torch

Case = dict[str, torch.Tensor]


def edges(case: Case) -> WalkInputs:
    return WalkInputs(*(case[name] for name in WalkInputs._fields))


def torch_walk(case: Case) -> Walk:
    """walk_torch of the case, with its uniforms."""
    return walk_torch(edges(case), case["uniforms"])


def seeded_walk(case: Case) -> Walk:
    """walk() of the case, with its rows' seed and first_step."""
    return walk(edges(case), case["seed"], case["first_step"])

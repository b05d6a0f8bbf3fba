"""The sampling state of every running request, per slot on the device (the slot the engine's
device state gives it): the parameters the sampler reads per row, declared once in SLOT_FIELDS,
and the logit controls' tables (control_state.py).

A request's row is written once, when it takes its slot (`admit`: admitted, or resumed after a
preemption); a step reads its rows' (`batch`). Slot num_slots is the scratch slot of a CUDA
graph's padded rows: it keeps every field's neutral value. The engine's memory sizing counts
SAMPLING_SLOT_BYTES per slot, from the same declaration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchrun.device import put
from batchrun.sampling.control_state import ControlState, SlotRequest
from batchrun.sampling.params import SamplingParams
from batchrun.sampling.sampler import SamplingBatch

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


def as_int64(value: int) -> int:
    """A 64-bit integer (any integer, taken mod 2^64) as the int64 with the same bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass(frozen=True)
class SlotField:
    """A SamplingParams field kept per slot, named as SamplingBatch names it. A slot no request
    has filled holds the field's default (greedy, nothing filtered). vocab_capped: a value of the
    vocabulary size or more means what 0 means (keep every token) and is stored as 0. An int64
    field takes any integer modulo 2^64 (a seed)."""

    name: str
    dtype: torch.dtype
    vocab_capped: bool = False

    @property
    def neutral(self) -> float:
        value = _DEFAULTS[self.name]
        assert isinstance(value, (int, float))
        return value

    def value(self, params: SamplingParams, vocab_size: int) -> float:
        value = getattr(params, self.name)
        if self.vocab_capped and value >= vocab_size:
            return 0
        return as_int64(value) if self.dtype == torch.int64 else value


SLOT_FIELDS = (
    SlotField("temperature", torch.float32),
    SlotField("top_p", torch.float32),
    SlotField("top_k", torch.int64, vocab_capped=True),
    SlotField("seed", torch.int64),
    SlotField("min_p", torch.float32),
)
# What one slot's row of the tables takes (the control tables are allocated only for a job that
# uses them, so a lower bound leaves them out).
SAMPLING_SLOT_BYTES = sum(f.dtype.itemsize for f in SLOT_FIELDS)


class SlotTables:
    """tables[name]: [num_slots + 1] of each SLOT_FIELDS field; controls: the logit controls'."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.tables = {
            f.name: torch.full((num_slots + 1,), f.neutral, dtype=f.dtype, device=device)
            for f in SLOT_FIELDS
        }
        self.controls = ControlState(num_slots, vocab_size, device)

    def admit(self, reqs: Sequence[SlotRequest], slots: torch.Tensor) -> None:
        """Fill `slots` (on the device) from the requests that just took them."""
        for f in SLOT_FIELDS:
            values = [f.value(r.params, self.vocab_size) for r in reqs]
            self.tables[f.name][slots] = put(values, f.dtype, self.device)
        self.controls.admit(reqs, slots)

    def batch(self, slots: torch.Tensor, steps: torch.Tensor) -> SamplingBatch:
        """The sampling parameters of rows owned by `slots`, drawing output token `steps`."""
        rows = {name: table[slots] for name, table in self.tables.items()}
        return SamplingBatch(step=steps, **rows)

"""Host memory on the CPU path: freed blocks of a step's size are reused, not faulted in afresh."""

from __future__ import annotations

import resource

import pytest
import torch

from batchrun.engine.host_memory import keep_freed_memory


def test_a_steps_temporaries_are_reused_not_faulted_in_each_step() -> None:
    if not keep_freed_memory():
        pytest.skip("no glibc: the allocator is left as it is")
    pages = (20 << 20) // resource.getpagesize()  # a 20 MB temporary, as a layer's K/V gather
    # Twice first, so the heap has grown to hold it: where the small result of the first
    # sum lands can leave the first block's place too short for the next (seen on one
    # machine of this kind: one fault-in more, then none).
    for _ in range(2):
        torch.ones(20 << 18).sum()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        torch.ones(20 << 18).sum()  # float32: 20 MB, written, freed
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # Given back at each free, every step would fault its pages in again (10 x pages).
    assert faults < pages, (faults, pages)

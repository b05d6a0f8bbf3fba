"""The Python heap around a job's step loop.

A collection of the oldest generation walks every object the collector tracks: the modules of
torch and transformers, the model's, the tokenizer's. After an engine is built these live as long
as the job, yet one such collection took 0.2 s on this project's CI machine (340,000 objects),
the time of tens of GPU steps, and it falls at random into the step loop. So the engine moves
what exists once it is built out of the collector's sight (`gc.freeze`, as vLLM's engine does):
collections then walk only what the job made since.
"""

from __future__ import annotations

import atexit
import gc


def collect_everything() -> None:
    """Collect all garbage, frozen objects included: an engine dropped before (its CUDA graphs
    hold reference cycles) gives back its memory now."""
    gc.unfreeze()
    gc.collect()


def freeze_heap() -> None:
    """Move every object alive now to the permanent generation, which no collection walks,
    after collecting all garbage (frozen before or not). At exit they go back, for the
    interpreter's last collection to free them: extension modules report objects still alive
    then as leaks (Triton's bindings, a page of them)."""
    collect_everything()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however many engines were built
    atexit.register(gc.unfreeze)

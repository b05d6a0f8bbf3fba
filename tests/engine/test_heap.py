"""The engine keeps the garbage collector's walks short: what exists once it is built is frozen,
and an engine dropped before is freed when the next is built."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine


def _engine(target: Path) -> Engine:
    return Engine(EngineConfig(target=target, device="cpu", dtype="float32"))


def test_a_built_engine_leaves_the_collector_little_to_walk(tiny_model: Path) -> None:
    _engine(tiny_model)
    # torch's, transformers' and the engine's objects: out of every collection's walk.
    assert gc.get_freeze_count() > 50_000
    assert len(gc.get_objects()) < 1_000


def test_a_dropped_engine_is_freed_when_the_next_is_built(tiny_model: Path) -> None:
    first = _engine(tiny_model)
    first.self = first  # type: ignore[attr-defined]  # a cycle, as CUDA graphs' closures make
    model = weakref.ref(first.model)
    del first  # frozen, and kept by the cycle from being freed on its reference count
    _engine(tiny_model)
    assert model() is None


def test_a_process_that_froze_its_heap_exits_quietly() -> None:
    """Frozen objects still alive at exit are reported as leaks by Triton's bindings (triton
    3.9), unless they are handed back to the collector first."""
    code = (
        "import sys, batchrun.attention.triton_backend\n"
        "from batchrun.engine.heap import freeze_heap\n"
        "freeze_heap(); freeze_heap(); sys.exit(2)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr == ""

"""The CUDA graphs a replayed step runs in, as the engine captures and picks them: the target's
(engine/model_runner.py's graph_shape over the sizes engine/cuda_graphs.py captures for each
verify width) and the draft's (the ladder size of its drafting requests). A graph runs its
padded rows: a step of 25 requests at width 16 pays for 32 x 16 rows, and one whose rows verify
at 16 and 1 pays for its requests' ladder size times the narrowest width that holds them all."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from batchrun.engine.cuda_graphs import GraphSet, graph_sizes, ladder_bucket
from batchrun.engine.model_runner import ModelRunner


class StepGraphs:
    """The graphs of a job at `batch` requests and `budget` tokens a step, the target's
    captured for each of `widths` (the speculator's)."""

    def __init__(self, batch: int, budget: int, widths: tuple[int, ...]) -> None:
        self.batch = batch
        target: dict[int, GraphSet] = {}
        for width in widths:
            graphs = GraphSet(
                f"target{width}", lambda size: (), lambda size: None, torch.device("cpu")
            )
            graphs.graphs = {s: (None, ()) for s in graph_sizes(batch, width, budget)}
            target[width] = graphs
        self._runner = SimpleNamespace(target_graphs=target, graph_max_q=max(widths))

    def target_rows(self, widths: tuple[int, ...]) -> int | None:
        """The rows of the target graph a step of decoding requests with these widths replays
        (None: it runs eagerly)."""
        shape = ModelRunner.graph_shape(self._runner, list(widths))  # type: ignore[arg-type]
        return None if shape is None else shape[1]

    def draft_requests(self, drafting: int) -> int:
        """The requests of the draft's graph for `drafting` requests (its ladder size)."""
        return ladder_bucket(drafting, self.batch) if drafting else 0

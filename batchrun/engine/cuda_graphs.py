"""CUDA graphs of the steady-state step: every request decodes (1 row each for plain decode, B
for a DFlash draft block or verify), for a ladder of batch sizes.

A graph's function reads only persistent buffers (the packed step, the per-slot state, the
drafts), builds the step's inputs from them on the device and runs the forward, so a replay
needs nothing but the one copy of the packed step. Padding requests sit in the scratch slot,
feed no rows and write no K/V. Graphs are captured largest first into one memory pool, as
their outputs are read before the next replay. `GraphHost` is this machinery as the runner
uses it for the target's graphs and lends it to the speculator's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any, cast

import torch

from batchrun.attention.base import AttentionBackend, GraphShape, HostPlanned
from batchrun.attention.meta import AttentionMeta
from batchrun.engine.step_inputs import graph_step_args, pad_graph_step
from batchrun.spec_decode.base import Graphs, StepShape

BATCH_LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256)

Outputs = tuple[torch.Tensor, ...]
Scope = Callable[[int], AbstractContextManager[Any]]  # around a size's warm-up and capture


def batch_ladder(max_batch_size: int) -> list[int]:
    sizes = [n for n in BATCH_LADDER if n < max_batch_size]
    return [*sizes, max_batch_size]


def graph_sizes(max_batch_size: int, width: int, max_batched_tokens: int) -> list[int]:
    """The ladder sizes a step of `width` can replay at: up to the most requests whose rows
    fit the token budget, rounded up to the ladder (wider steps are never scheduled)."""
    ladder = batch_ladder(max_batch_size)
    most = max(max_batched_tokens // width, 1)
    return [s for s in ladder if s < most] + [s for s in ladder if s >= most][:1]


def graph_rows(max_batch_size: int, widths: tuple[int, ...], max_batched_tokens: int) -> int:
    """The rows of the largest target graph over these verify widths (its logits' rows)."""
    return max(max(graph_sizes(max_batch_size, w, max_batched_tokens)) * w for w in widths)


def ladder_bucket(num_requests: int, max_batch_size: int) -> int:
    """The ladder size a batch of num_requests runs at (its graph size, where graphs exist)."""
    return min(s for s in batch_ladder(max_batch_size) if s >= min(num_requests, max_batch_size))


class GraphSet:
    """One step function captured at each batch size of a ladder.

    Off a GPU the graphs are emulated: a replay runs the function on the persistent buffers,
    padded as a real replay would be, so the CPU tests cover everything but the capture itself.
    """

    def __init__(
        self,
        name: str,
        fn: Callable[[int], Outputs],
        clear: Callable[[int], None],
        device: torch.device,
    ) -> None:
        self.name, self.fn, self.clear = name, fn, clear
        self.emulated = device.type != "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, Outputs]] = {}

    def capture(self, sizes: list[int], pool: Any, scope: Scope | None = None) -> None:
        """Capture each size; `scope` (a host-planned attention backend's) is open around its
        warm-up and capture, which emulated graphs then run too."""
        for size in sorted(sizes, reverse=True):
            self.clear(size)  # every request padding: the capture writes nothing
            with scope(size) if scope is not None else nullcontext():
                if self.emulated:
                    if scope is not None:
                        self.fn(size)  # the warm-up plans what a replay needs
                    self.graphs[size] = (None, ())
                    continue
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self.fn(size)  # warm-up: lazy initialisation stays out of the graph
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outputs = self.fn(size)
                # A graph's first launch uploads it: do that here (the padding step writes
                # nothing), not in the job's first step at this width, whose time the verify-
                # width policy would count.
                graph.replay()
                self.graphs[size] = (graph, outputs)

    def __contains__(self, size: int) -> bool:
        return size in self.graphs

    def bucket(self, num_requests: int) -> int | None:
        return min((s for s in self.graphs if s >= num_requests), default=None)

    def replay(self, size: int) -> Outputs:
        """Replay the graph of `size` on what the buffers hold (load them first)."""
        graph, outputs = self.graphs[size]
        if graph is None:
            return self.fn(size)
        graph.replay()
        return outputs


class GraphHost:
    """The graph machinery over one packed step buffer (the runner's): the ladder, capture and
    replay inside the host-planned attention backends' scopes, and the count of replays."""

    def __init__(
        self,
        step_in: torch.Tensor,
        *,
        scratch_slot: int,
        max_kv: int,
        page_size: int,
        max_batched_tokens: int,
    ) -> None:
        """step_in: the packed step buffer every graph reads; max_kv, page_size: what every
        graph is planned for (the most positions a step touches)."""
        self.step_in, self.scratch_slot, self.device = step_in, scratch_slot, step_in.device
        self.max_kv, self.page_size = max_kv, page_size
        self.max_batched_tokens = max_batched_tokens
        self.replays: Counter[tuple[str, int]] = Counter()  # (graph set, batch size) -> replays

    def sizes(self, max_batch_size: int, width: int) -> list[int]:
        return graph_sizes(max_batch_size, width, self.max_batched_tokens)

    def bucket(self, num_requests: int, max_batch_size: int) -> int:
        return ladder_bucket(num_requests, max_batch_size)

    def slots(self, size: int) -> torch.Tensor:
        return graph_step_args(self.step_in, size).slot

    def clear(self, size: int) -> None:
        pad_graph_step(self.step_in, size, self.scratch_slot)

    def capture(
        self,
        name: str,
        fn: Callable[[int], Outputs],
        sizes: list[int],
        planned: tuple[list[AttentionBackend], int],
        pool: Any,
    ) -> GraphSet:
        graphs = GraphSet(name, fn, self.clear, self.device)
        graphs.capture(sizes, pool, self._capture_scope(name, *planned))
        return graphs

    def replayable(self, graphs: Graphs | None, step: StepShape) -> bool:
        return step.uniform and graphs is not None and step.num_requests in graphs

    def replay(
        self,
        graphs: Graphs,
        size: int,
        backends: list[AttentionBackend],
        metas: Callable[[], list[AttentionMeta]],
    ) -> Outputs:
        """Host-planned backends plan a replay from the step's metas (one per backend, in
        order), built eagerly by the same code the graph runs."""
        graph_set = cast(GraphSet, graphs)
        self.replays[graph_set.name, size] += 1
        with ExitStack() as stack:
            planned = _host_planned(backends)
            for backend, meta in zip(planned, metas() if planned else [], strict=True):
                stack.enter_context(backend.replaying((graph_set.name, size), meta))
            return graph_set.replay(size)

    def _capture_scope(
        self, name: str, backends: list[AttentionBackend], q_len: int
    ) -> Scope | None:
        """The host-planned backends' scopes around a graph's capture (None: no such backend)."""
        planned = _host_planned(backends)
        if not planned:
            return None

        def scope(size: int) -> ExitStack:
            stack = ExitStack()
            shape = GraphShape(size, q_len, self.max_kv, self.page_size)
            for backend in planned:
                stack.enter_context(backend.capturing((name, size), shape))
            return stack

        return scope


def _host_planned(backends: list[AttentionBackend]) -> list[HostPlanned]:
    return [cast(HostPlanned, b) for b in backends if b.host_planned]

"""Constrained requests whose grammar is compiling (sampling/grammar_compile.py). One joins the
scheduler's queue once its grammar is ready, and the scheduler finishes it as an error when it
has none (it does not compile, or breaks the budget); every other request decodes meanwhile, so
a row waits only for its own grammar.

With tensor parallelism the ranks must admit alike, and compile times differ between them:
rank 0's view decides (its compiles alone keep a time budget), and a rank told a grammar is
ready waits for its own compile of it, which rank 0 has finished."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from batchrun.engine.core.requests import Request
from batchrun.errors import JobError
from batchrun.sampling.grammar import Grammars
from batchrun.sampling.grammar_compile import CompileJob
from batchrun.sampling.row_grammar import RowGrammar

if TYPE_CHECKING:
    from batchrun.engine.core.scheduler import Scheduler
    from batchrun.parallel.group import TensorParallel

# An engine with nothing else to run waits this long for a compile at a time, then steps (so a
# stop signal is seen between waits).
WAIT_SECONDS = 0.05

# A compile's state as ranks agree on it: under way (None), ready (True), or why not (str).
State = bool | str | None


class GrammarsOnce:
    """The structured outputs' compiler, made for the first constrained request (the prefetch
    thread may ask for it first)."""

    def __init__(self, make: Callable[[], Grammars]) -> None:
        self._make = make
        self._grammars: Grammars | None = None
        self._made = threading.Lock()

    def get(self) -> Grammars:
        with self._made:
            if self._grammars is None:
                self._grammars = self._make()
            return self._grammars


class Compiling:
    def __init__(self, tp: TensorParallel | None, fail: Callable[[Request, str], None]) -> None:
        """fail: finishes a request whose grammar has none as an error (the scheduler's
        `fail`: the scheduler alone writes request state)."""
        self.tp, self.fail = tp, fail
        self.waiting: list[tuple[Request, CompileJob]] = []

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, req: Request, job: CompileJob) -> None:
        self.waiting.append((req, job))

    def clear(self) -> None:
        self.waiting.clear()

    def settle(self, grammars: Grammars) -> tuple[list[tuple[Request, CompileJob]], list[Request]]:
        """Takes out the requests whose compile is over: those to admit with their compile,
        and those finished as errors."""
        if not self.waiting:
            return [], []
        states: list[State] = [_state(grammars, job) for _, job in self.waiting]
        if self.tp is not None:
            states = self.tp.of_first(states)
        ready, failed, left = [], [], []
        for (req, job), state in zip(self.waiting, states, strict=True):
            if state is None:
                left.append((req, job))
            elif state is True:
                grammars.wait([job], None)  # over on rank 0; on another, maybe not yet
                if job.error is not None:
                    raise JobError(f"tensor-parallel ranks disagree on a grammar: {job.error}")
                ready.append((req, job))
            else:
                self.fail(req, str(state))
                failed.append(req)
        self.waiting = left
        return ready, failed

    def admit_ready(
        self, grammars: Grammars, scheduler: Scheduler, think: tuple[int, int] | None
    ) -> list[Request]:
        """Requests whose compile is over join the scheduler's queue with their grammar (the
        answer's after a think block when a reasoning parser splits the output; think: the
        think token ids); returns those finished as errors."""
        ready, failed = self.settle(grammars)
        for req, job in ready:
            row_think = think if req.params.reasoning else None
            grammar = RowGrammar.of(grammars.matcher_of(job), row_think, req.prompt_ids)
            scheduler.add(req, grammar=grammar)
        return failed

    def wait(self, grammars: Grammars) -> None:
        """Until a compile is over, or WAIT_SECONDS."""
        grammars.wait([job for _, job in self.waiting], WAIT_SECONDS)


def _state(grammars: Grammars, job: CompileJob) -> State:
    if not grammars.poll(job):
        return None
    return True if job.error is None else job.error

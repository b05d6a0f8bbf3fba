"""What a runner needs of an engine, how it builds one, and how it feeds it requests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from batchrun.config.job import JobSpec
from batchrun.engine.core.requests import Request
from batchrun.sampling.grammar import Grammars

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from batchrun.engine.batch_choice import BatchChoice
    from batchrun.parallel.group import TensorParallel

QUEUE_FACTOR = 4  # requests queued in the engine, per unit of max_batch_size


class EngineLike(Protocol):
    """What the runners need of an engine (batchrun.engine.engine.Engine, or a test fake)."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    max_model_len: int  # prompt + output tokens must fit
    vocab_size: int  # valid token ids: 0 <= id < vocab_size

    @property
    def max_batch_size(self) -> int: ...  # requests in flight: given, or chosen at start-up

    @property
    def block_size(self) -> int | None: ...  # DFlash block size; None without a draft

    @property
    def grammars(self) -> Grammars: ...  # structured outputs' compiler (made when first read)

    def info(self) -> dict[str, Any]: ...

    def add(self, request: Request) -> None: ...

    def step(self) -> list[Request]: ...

    def abort_all(self) -> None: ...  # drop every request not finished (a stopped run)

    @property
    def num_unfinished(self) -> int: ...


def build_engine(
    job: JobSpec,
    tokenizer: PreTrainedTokenizerBase | None = None,
    tp: TensorParallel | None = None,
    batch: BatchChoice | None = None,
) -> EngineLike:
    """The job's engine (with tp, this rank's); `tokenizer`, when preflight has loaded it
    already, is not loaded again, nor the batch it has chosen (None: the engine chooses)."""
    from batchrun.engine.engine import Engine  # the model stack loads only when a job runs

    return Engine(job.engine_config(), tokenizer, tp, batch=batch)


def generate(
    engine: EngineLike,
    requests: Iterator[Request],
    max_queued: int,
    stopping: Callable[[], bool] | None = None,
) -> Iterator[list[Request]]:
    """Feed `requests` to the engine, keeping at most max_queued unfinished, and step it until
    every one has finished; yields each step's finished requests (often none). stopping() is
    asked before each step: when it says so, generate returns at once, leaving the requests
    not finished in the engine (and those not yet read in `requests`)."""
    exhausted = False
    while True:
        if stopping is not None and stopping():
            return
        while not exhausted and engine.num_unfinished < max_queued:
            request = next(requests, None)
            if request is None:
                exhausted = True
            else:
                engine.add(request)
        if engine.num_unfinished == 0:
            return  # and the input is exhausted, else the queue would not be empty
        yield engine.step()

"""Input rows -> requests -> output rows: the one row pipeline of every runner (the local run,
each torchrun rank, each --workers worker, the Ray processor).

A row source's batches become rows with their request (or why they cannot run), each schedule
window of them put in admission order; a row that cannot run becomes its error rows (n of them);
a row whose n samples have all finished becomes its output rows, its reasoning split off. How
far rows are read and queued ahead is the runner's (Pace): the engine is fed by the runner.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import pyarrow as pa

from batchrun.config.job import JobSpec
from batchrun.engine.core.requests import Request
from batchrun.io.input.prompts import PromptColumn, RequestBuilder
from batchrun.io.input.reader import InputBatch
from batchrun.io.output.columns import OutputRow, error_rows, finished_row
from batchrun.io.output.reasoning import reasoning_split
from batchrun.io.output.row_samples import RowSamples
from batchrun.runners.admission_order import admission_order
from batchrun.runners.engine_feed import QUEUE_FACTOR, EngineLike

PREFETCH_ROWS = 512  # input rows read and tokenized ahead of the engine


T = TypeVar("T")


def windowed(
    items: Iterator[T],
    window: int,
    max_len: int,
    page_size: int,
    request: Callable[[T], Request | None],
) -> Iterator[T]:
    """The items, each run of `window` of them reordered: those without a request (error
    rows) first, as they come, then the others in the admission_order of their requests;
    window 0 passes them on in their own order."""
    if window <= 0:
        yield from items
        return
    while chunk := list(itertools.islice(items, window)):
        runnable: dict[int, tuple[Request, T]] = {}
        for item in chunk:
            req = request(item)
            if req is None:
                yield item
            else:
                runnable[id(req)] = (req, item)
        for req in admission_order([req for req, _ in runnable.values()], max_len, page_size):
            yield runnable[id(req)][1]


class InputRow(NamedTuple):
    """One input row on its way to the engine."""

    row_index: int
    seq: int  # its place in the order the pipeline read rows (0, 1, ...)
    inputs: pa.RecordBatch  # its input columns
    values: dict[str, Any]  # its values of the columns read
    request: Request | str  # or why it cannot run
    outputs: int  # its output rows: its n (1 when that n is itself invalid)


@dataclass(frozen=True)
class Pace:
    """How far ahead a runner reads and queues: rows read and tokenized ahead, requests
    waiting in the engine, rows reordered together for admission (0: none)."""

    prefetch_rows: int
    max_queued: int
    window: int

    @classmethod
    def of(cls, job: JobSpec, batch: int) -> Pace:
        """A job's own pace, with its engine's batch."""
        queued = QUEUE_FACTOR * batch
        return cls(PREFETCH_ROWS, queued, job.run.schedule_window)


def request_builder(
    job: JobSpec,
    prompt: PromptColumn,
    schema: pa.Schema,
    engine: EngineLike,
    own_tokenizer: bool = False,
) -> RequestBuilder:
    """What turns input rows of this schema into the engine's requests; own_tokenizer: with a
    copy of the engine's tokenizer (a builder used on a thread of its own)."""
    tokenizer = copy.deepcopy(engine.tokenizer) if own_tokenizer else engine.tokenizer
    return RequestBuilder(
        job.row_defaults(),
        prompt,
        schema,
        tokenizer,
        engine.max_model_len,
        engine.vocab_size,
        lambda: engine.grammars,
    )


class RowPipeline:
    """See the module docstring. The samples of rows not finished are held here, by the key
    the runner gives (a row_index, or a row's place in its batch). Raises JobError for a
    reasoning_parser the engine's tokenizer cannot serve."""

    def __init__(self, job: JobSpec, engine: EngineLike, window: int) -> None:
        self.window = window
        self.max_len, self.page_size = engine.max_model_len, job.engine_config().page_size
        self.reasoning = reasoning_split(job.output.reasoning_parser, engine.tokenizer)
        self._samples: RowSamples[Request] = RowSamples()

    def rows(
        self,
        batches: Iterable[InputBatch],
        builder: RequestBuilder,
        id_columns: Sequence[str] = (),
    ) -> Iterator[InputRow]:
        """Each row of the batches with its request (or why not), built by `builder`; in each
        window of rows, those that cannot run first, then the others in admission order.
        id_columns: read into each row's values too (for the error log)."""

        def built() -> Iterator[InputRow]:
            seq = 0
            for batch in batches:
                row_indices = batch.row_indices.tolist()
                rows = builder.build_batch(batch.batch, row_indices, id_columns)
                for i, (values, request) in enumerate(rows):
                    inputs, outputs = batch.batch.slice(i, 1), builder.output_rows(values)
                    yield InputRow(row_indices[i], seq, inputs, values, request, outputs)
                    seq += 1

        return windowed(
            built(),
            window=self.window,
            max_len=self.max_len,
            page_size=self.page_size,
            request=lambda row: row.request if isinstance(row.request, Request) else None,
        )

    @staticmethod
    def error_rows(row: InputRow) -> list[OutputRow]:
        """The output rows of a row that cannot run (row.request says why)."""
        assert isinstance(row.request, str)
        return error_rows(row.row_index, row.request, row.outputs)

    def finished(self, key: int, request: Request) -> list[OutputRow] | None:
        """Take a finished sample of row `key`; the row's output rows once it was its last."""
        done = self._samples.add(key, request.sample_index, request.params.n, request)
        if done is None:
            return None
        return [finished_row(sample, self.reasoning) for sample in done]

    def clear(self) -> None:
        """Forget the rows with samples still to come (a stopped run, a batch that failed)."""
        self._samples.clear()

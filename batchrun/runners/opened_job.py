"""A job's start-up checks that need no model: inputs, columns and the output directory."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from batchrun.config.fingerprint import job_fingerprint
from batchrun.config.job import JobSpec
from batchrun.errors import JobError
from batchrun.io.input.prompts import PromptColumn, find_id_column, find_prompt_column
from batchrun.io.input.reader import InputSource, open_input
from batchrun.io.input.row_tokens import sample_row_tokens
from batchrun.io.input.shards import shard_rows
from batchrun.io.output.directory import DAMAGED_DIR, PROGRESS_DIR, OutputDir
from batchrun.io.output.sink import SinkTarget

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from batchrun.engine.batch_choice import RowTokens


@dataclass(frozen=True)
class OpenedJob:
    """What the start-up checks found; nothing has been written yet."""

    job: JobSpec
    source: InputSource
    prompt: PromptColumn
    id_column: str | None
    schema: pa.Schema  # of every output part
    out: OutputDir
    fingerprint: dict[str, Any]

    @property
    def rows(self) -> range:
        """The row_index range this run covers: its shard's (whole row groups), or every row."""
        return shard_rows(self.source, self.job.run.shard_spec)

    def sink_target(self, *, quiet: bool | None = None) -> SinkTarget:
        """Where the job's output sink writes (quiet: the job's, unless given)."""
        return SinkTarget(
            out=self.out,
            schema=self.schema,
            total_rows=self.source.total_rows,
            rows=self.rows,
            rows_per_part=self.job.output.rows_per_part,
            part_seconds=self.job.output.part_seconds,
            quiet=self.job.run.quiet if quiet is None else quiet,
            id_column=self.id_column,
        )

    def prepare_output(self) -> None:
        """Prepare the claimed output for this run (batchrun.io.output.directory's prepare), saying
        which damaged parts were moved aside: their rows are redone."""
        damaged = self.out.prepare(self.fingerprint, self.job.output.overwrite)
        if damaged:
            print(
                f"batchrun: warning: {len(damaged)} damaged part(s) moved to "
                f"{PROGRESS_DIR}/{DAMAGED_DIR}/ ({', '.join(damaged)}); their rows are redone",
                file=sys.stderr,
            )

    def row_tokens(
        self, tokenizer: PreTrainedTokenizerBase, max_model_len: int, vocab_size: int
    ) -> RowTokens | None:
        """How long this run's rows are, from its first rows (io/input/row_tokens.py)."""
        return sample_row_tokens(
            self.source,
            self.rows,
            self.prompt,
            self.job.row_defaults(),
            tokenizer,
            max_model_len,
            vocab_size,
        )

    def committed_rows(self) -> int:
        """The rows of this run's range (its shard's, or every row) in committed parts."""
        rows = self.rows
        return int(self.out.done_mask(self.source.total_rows)[rows.start : rows.stop].sum())


def open_job(job: JobSpec) -> OpenedJob:
    """Every check that needs no model: inputs, columns, output directory. Raises JobError."""
    for key in ("target", "draft"):
        model = job.value(key)
        if model is not None and not Path(model).is_dir():
            raise JobError(f"{key} model directory {model!r} does not exist")
    source = open_input(job.input.path, exclude=job.output.directory)
    prompt = find_prompt_column(source.schema, job.input)
    id_column = find_id_column(source.schema, job.input.id_column)
    schema = job.output_schema(source.schema)
    rows = shard_rows(source, job.run.shard_spec)
    out = OutputDir.at(job.output.directory, job.run.shard_spec, rows, job.output.claims_dir)
    fingerprint = job_fingerprint(job, source, prompt)
    out.check(fingerprint, job.output.overwrite)
    return OpenedJob(job, source, prompt, id_column, schema, out, fingerprint)

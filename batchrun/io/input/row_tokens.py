"""How long a job's rows are, from the first rows it will read, built as the run builds them
(their prompt tokens and max_tokens): what an unset max_batch_size is chosen for
(engine/batch_choice.py). Rows that cannot run say nothing of it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from batchrun.engine.batch_choice import RowTokens
from batchrun.engine.core.requests import Request
from batchrun.errors import JobError
from batchrun.io.input.prompts import PromptColumn, RequestBuilder, RowDefaults
from batchrun.io.input.reader import InputSource, RowSelection, iter_batches

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SAMPLE_ROWS = 64  # rows read and tokenized: a row group's first, at most


def sample_row_tokens(
    source: InputSource,
    rows: range,
    prompt: PromptColumn,
    defaults: RowDefaults,
    tokenizer: PreTrainedTokenizerBase,
    max_model_len: int,
    vocab_size: int,
) -> RowTokens | None:
    """The longest prompt and the largest max_tokens among the first SAMPLE_ROWS rows of
    `rows` that build into requests; None when none does."""
    builder = RequestBuilder(
        defaults, prompt, source.schema, tokenizer, max_model_len, vocab_size, grammars=None
    )
    selection = RowSelection(np.zeros(source.total_rows, dtype=bool), rows)
    built: list[Request] = []
    try:
        for read in iter_batches(source, selection, builder.columns):
            take = read.batch.slice(0, SAMPLE_ROWS - len(built))
            pairs = builder.build_batch(take, read.row_indices[: take.num_rows].tolist())
            built += [request for _, request in pairs if isinstance(request, Request)]
            if len(built) >= SAMPLE_ROWS or read.batch.num_rows >= SAMPLE_ROWS:
                break
    except JobError:  # an unreadable file: the run says so where it reads it
        pass
    if not built:
        return None
    prompt_tokens = max(len(r.prompt_ids) for r in built)
    output = max(r.params.max_tokens for r in built)
    output = min(output, max(1, max_model_len - prompt_tokens))
    return RowTokens(prompt_tokens, output, f"the input's first {len(built)} rows")

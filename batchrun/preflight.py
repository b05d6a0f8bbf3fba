"""The start-up checks of a job that need no weights, shared by `validate` and `run`.

`run` calls `preflight` before it loads any weights and `validate` calls it instead of loading
them, so a job `validate` accepts cannot be refused at start-up by `run`. Each check is the
function the engine itself calls while it loads (device, attention backend, target config,
dtype, draft fit, batch budget, tokenizer), so the two cannot drift apart either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from batchrun.engine.config import check_batch_budget
from batchrun.engine.loading import (
    auto_candidates,
    backend_name,
    check_backend_dtype,
    load_tokenizer,
    resolve_device,
)
from batchrun.errors import JobError
from batchrun.io.prompts import PromptColumn, PromptKind
from batchrun.models.dflash_loader import DraftSpec, check_draft
from batchrun.models.loader import qwen3_shape, read_config, resolve_dtype
from batchrun.models.qwen3 import Qwen3Shape

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from batchrun.job import JobSpec


@dataclass(frozen=True)
class Preflight:
    """What the job will run with, found from config and tokenizer files alone."""

    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    target: Qwen3Shape
    tokenizer: PreTrainedTokenizerBase
    draft: DraftSpec | None

    @property
    def block_size(self) -> int | None:
        return self.draft.block_size if self.draft is not None else None


def preflight(job: JobSpec, prompt: PromptColumn | None = None) -> Preflight:
    """Check everything the engine checks while it loads, without loading weights; with the
    input's prompt column, also that the tokenizer can render it. Raises JobError."""
    config = job.engine_config()
    device = resolve_device(config.device)
    backend = backend_name(config.attention_backend, device)
    target_config = read_config(config.target, "target model")
    target = qwen3_shape(target_config)
    dtype = resolve_dtype(config.dtype, target_config, device)
    check_backend_dtype(backend, dtype)
    candidates = auto_candidates(device, dtype)
    if config.attention_backend == "auto" and len(candidates) > 1:
        backend = f"{' or '.join(candidates)}, the faster measured at start-up"
    draft = check_draft(config.draft, target) if config.draft is not None else None
    check_batch_budget(config.max_batched_tokens, draft.block_size if draft is not None else 1)
    tokenizer = load_tokenizer(config.target)
    if prompt is not None and prompt.kind is PromptKind.MESSAGES and not tokenizer.chat_template:
        raise JobError(
            f"prompt column {prompt.name!r} holds chat messages, "
            "but the target's tokenizer has no chat template"
        )
    return Preflight(device, dtype, backend, target, tokenizer, draft)

"""The start-up checks of a job that need no weights, shared by `validate` and `run`.

`run` calls `preflight` before it loads any weights and `validate` calls it instead of loading
them, so a job `validate` accepts cannot be refused at start-up by `run`. Each check is the
function the engine itself calls while it loads (device, attention backend, target config,
dtype, draft fit, batch budget, verify width, tokenizer, end-of-sequence ids, and the weights'
names and shapes, which load_weights checks here against tensors of the checkpoints' headers on
the meta device), so the two cannot drift apart either; and the batch limits are held to what
the device's memory could run at all (engine/memory.py, check_batch_memory). An unset
max_batch_size is chosen here (engine/batch_choice.py), so validate says the batch run uses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from batchrun.attention.kv_dtype import kv_element_size
from batchrun.device import resolve_device
from batchrun.engine.attention_backends import (
    auto_candidates,
    backend_name,
    check_backend_dtype,
    check_backend_kv,
)
from batchrun.engine.batch_choice import BatchChoice, RowTokens, job_batch, rule_applies
from batchrun.engine.config import EngineConfig, check_batch_budget
from batchrun.engine.memory import (
    BatchFootprint,
    check_batch_memory,
    context_limit,
    device_memory_bytes,
    job_kv_pages,
    usable_context,
)
from batchrun.errors import JobError
from batchrun.io.input.prompts import THINKING_NEEDS_TOKENS, PromptColumn, PromptKind
from batchrun.io.output.reasoning import reasoning_split
from batchrun.models.config_check import check_transformers_reads
from batchrun.models.families import family_of
from batchrun.models.header_weights import header_tensors
from batchrun.models.loader import (
    config_file,
    load_weights,
    qwen3_shape,
    read_config,
    resolve_dtype,
    target_weights,
)
from batchrun.models.meta import shapes_only
from batchrun.models.qwen3 import Qwen3Shape
from batchrun.models.tokenizer import eos_token_ids, load_tokenizer, think_token_ids
from batchrun.sampling.constraint import GrammarError
from batchrun.sampling.grammar import Grammars
from batchrun.spec_decode.method import CheckedDraft, DraftLayout
from batchrun.spec_decode.registry import check_draft
from batchrun.spec_decode.verify_widths import verify_widths

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from batchrun.config.job import JobSpec

# The job's rows' length, from its input (tokenizer, max_model_len, vocab size; None: not known).
RowSample = Callable[["PreTrainedTokenizerBase", int, int], RowTokens | None]


@dataclass(frozen=True)
class Preflight:
    """What the job will run with, found from config and tokenizer files alone."""

    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    target: Qwen3Shape
    family: str  # the target's model_type (models/families.py)
    tokenizer: PreTrainedTokenizerBase
    checked: CheckedDraft | None  # the draft, checked by its speculation method
    batch: BatchChoice  # the batch the engine runs, given or chosen
    skipped: tuple[str, ...] = ()  # parts of the target's checkpoint not run (vision tower)

    @property
    def draft(self) -> Any:
        """The draft as its method describes it (None: no draft)."""
        return self.checked.spec if self.checked is not None else None

    @property
    def block_size(self) -> int | None:
        return self.checked.layout.block_size if self.checked is not None else None


def preflight(
    job: JobSpec, prompt: PromptColumn | None = None, sample: RowSample | None = None
) -> Preflight:
    """Check everything the engine checks while it loads, without loading weights; with the
    input's prompt column, also that the tokenizer can render it; and choose the batch (unless
    the job gives it) for the rows `sample` finds (None, or it finds none: the model's max
    positions). Raises JobError."""
    config = job.engine_config()
    device = resolve_device(config.device)
    backend = backend_name(config.attention_backend, device)
    target_config = read_config(config.target, "target model")
    target = qwen3_shape(target_config, "target", config_file(config.target))
    check_transformers_reads(target_config, f"target: {config_file(config.target)}")
    dtype = resolve_dtype(config.dtype, target_config, device)
    check_backend_dtype(backend, dtype)
    check_backend_kv(backend, config.kv_cache_dtype)
    candidates = auto_candidates(device, dtype, config.kv_cache_dtype)
    if config.attention_backend == "auto" and len(candidates) > 1:
        backend = f"{' or '.join(candidates)}, the faster measured at start-up"
    checked = None
    if config.draft is not None:
        checked = check_draft(config.draft, config.speculative_method, target)
    draft = checked.layout if checked is not None else None
    check_batch_budget(config.max_batched_tokens, draft.block_size if draft is not None else 1)
    widths = verify_widths(config.verify_width, draft)
    tokenizer = load_tokenizer(config.target)
    if prompt is not None and prompt.kind is PromptKind.MESSAGES and not tokenizer.chat_template:
        raise JobError(
            f"prompt column {prompt.name!r} holds chat messages, "
            "but the target's tokenizer has no chat template"
        )
    _check_eos(config.target, target_config, tokenizer)
    reasoning_split(
        job.output.reasoning_parser, tokenizer
    )  # qwen3's think tokens, where the job asks for the split
    if job.sampling.max_thinking_tokens is not None and think_token_ids(tokenizer) is None:
        raise JobError(THINKING_NEEDS_TOKENS)
    outside = job.default_params().vocab_problem(target.vocab_size)
    if outside is not None:
        raise JobError(f"job key 'logit_bias': {outside}")
    _check_constraint(job, tokenizer, target.vocab_size, config)
    weights, skipped = check_checkpoints(config.target, target_config, target, checked, dtype)
    footprint = batch_footprint(
        target,
        draft,
        dtype,
        weights,
        min(widths),
        job.run.tp,
        config.page_size,
        config.kv_cache_dtype,
    )
    max_len = context_limit(config, target)
    rows = None
    if sample is not None and rule_applies(config.max_batch_size, device):
        rows = sample(tokenizer, max_len, target.vocab_size)  # read once more: only for the rule
    rows = rows or RowTokens.unknown(max_len, job.sampling.max_tokens)
    share = weights // job.run.tp  # a rank's (the draft's whole: less, a lower bound still)
    memory = (device_memory_bytes(device), share) if device.type == "cuda" else None
    batch = job_batch(config, target, draft, dtype, device, share, rows, memory)
    config = replace(config, max_batch_size=batch.size)
    check_batch_memory(footprint, batch.size, config.max_batched_tokens, device)
    _check_kv_pool(config, target, draft, dtype, device)
    family = str(target_config["model_type"])  # family_of has accepted it
    return Preflight(
        device, dtype, backend, target, family, tokenizer, checked, batch, tuple(skipped)
    )


def _check_kv_pool(
    config: EngineConfig,
    target: Qwen3Shape,
    draft: DraftLayout | None,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """The engine's refusal of a KV pool too small for a context of 2 tokens, from the pool
    kv_pages sizes before any weights load. On a GPU, with less of its memory in use than
    once the weights are loaded: a pool this finds too small, the engine's is too."""
    num_pages = config.num_pages or job_kv_pages(config, target, draft, dtype, device)
    usable_context(config, target, num_pages, draft.block_size if draft else 1, device)


def _check_constraint(
    job: JobSpec, tokenizer: PreTrainedTokenizerBase, vocab_size: int, config: EngineConfig
) -> None:
    """The job's structured output compiles within the budget (a row's own is that row's
    error)."""
    constraint = job.sampling.constraint
    if constraint is None:
        return
    problem = constraint.problem()
    if problem is None:
        try:
            Grammars(tokenizer, vocab_size, [], config.compile_budget).compile(constraint)
        except GrammarError as exc:
            problem = str(exc)
    if problem is not None:
        raise JobError(f"job key {constraint.kind!r}: {problem}")


def _check_eos(
    target_dir: Path, config: dict[str, Any], tokenizer: PreTrainedTokenizerBase
) -> None:
    """The end-of-sequence ids the engine reads: generation_config.json, else config.json."""
    try:
        eos_token_ids(target_dir, config, tokenizer)
    except (OSError, ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise JobError(
            f"cannot read the target's eos_token_id (generation_config.json or config.json in "
            f"{target_dir}): {exc}".splitlines()[0]
        ) from None


def check_checkpoints(
    target_dir: Path,
    target_config: Mapping[str, Any],
    target: Qwen3Shape,
    draft: CheckedDraft | None,
    dtype: torch.dtype,
) -> tuple[int, list[str]]:
    """The loaders' own checks of the weights' names and shapes (load_weights), run on models
    built on the meta device against the tensors the safetensors headers describe, so no weight
    is read (the draft's by its method). Returns the bytes the weights take (in `dtype`, but
    those kept in FP8) and the parts of the target's checkpoint it does not run. Raises
    JobError."""
    family, _ = family_of(target_config, "target")
    with shapes_only():
        model = family.model(target).to(dtype)
    if target.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    skip = {"lm_head.weight"} if target.tie_word_embeddings else set()
    tensors, skipped = target_weights(header_tensors(target_dir), target_config, target, model)
    load_weights(model, tensors, "target", skip)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if draft is not None:
        weight_bytes += draft.method.check_weights(draft.directory, draft.spec, target, dtype)
    return weight_bytes, skipped


def batch_footprint(
    target: Qwen3Shape,
    draft: DraftLayout | None,
    dtype: torch.dtype,
    weight_bytes: int,
    min_width: int,
    tp: int,
    page_size: int,
    kv_cache_dtype: str = "auto",
) -> BatchFootprint:
    """What a batch of this job needs at least, per engine (tensor-parallel rank): the target's
    weights split tp ways, the draft's whole; the target's K/V at kv_cache_dtype's size."""
    element = dtype.itemsize
    rings = draft.ring_pages(page_size) * draft.ring_layers if draft is not None else 0
    return BatchFootprint(
        target=target,
        draft=draft.shape if draft is not None else None,
        weight_bytes=weight_bytes // tp,  # less than this rank's share: a lower bound still
        element=element,
        width=draft.block_size if draft is not None else 1,
        min_width=min_width,
        page_size=page_size,
        draft_paged_layers=draft.paged_layers if draft is not None else 0,
        ring_pages=rings,
        tp=tp,
        kv_element=kv_element_size(kv_cache_dtype, element),
    )

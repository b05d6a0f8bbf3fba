"""The batch a job runs at: the one it gives (--max-batch-size), else the one engine/batch_size.py's
rule picks at start-up from the job's rows' length, the device's copy and matmul rates
(engine/device_rates.py, measured) and the KV pages memory.py sizes for each batch it tries.

A CPU's rates are not measured (a measurement there moves with the threads other processes
leave it): its batch is CPU_BATCH_SIZE, the default before the rule. The rule would stop a CPU
sooner (its matmuls outlast the weights' reading past about 2 x FLOP rate / bandwidth rows,
some 20 at 1 TFLOP/s and 100 GB/s), but a CPU job's rows are few and short: 64 keeps them as
they ran."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from batchrun.attention.kv_dtype import kv_element_size
from batchrun.engine.batch_size import DecodeCost, default_batch_size
from batchrun.engine.config import EngineConfig
from batchrun.engine.device_rates import Ceilings, measure_ceilings
from batchrun.engine.memory import job_kv_pages
from batchrun.errors import JobError
from batchrun.models.families import paged_layers
from batchrun.models.qwen3 import Qwen3Shape
from batchrun.spec_decode.method import DraftLayout

CPU_BATCH_SIZE = 64


@dataclass(frozen=True)
class RowTokens:
    """How long the job's rows are: the longest prompt and max_tokens the rule sizes for, and
    where they come from (the input's rows, or the model's max positions when unknown)."""

    prompt: int
    output: int
    source: str

    @classmethod
    def unknown(cls, max_positions: int, max_tokens: int = 1) -> RowTokens:
        """Rows of the model's full context (max_tokens of it output, as the job says; without
        a job the longest prompt): a job whose input was not read."""
        output = max(1, min(max_tokens, max_positions - 1))
        return cls(max_positions - output, output, "the model's max positions")


@dataclass(frozen=True)
class BatchChoice:
    size: int
    chosen: bool  # picked by the rule (max_batch_size unset), else given
    why: str  # one line: validate prints it

    @classmethod
    def given(cls, size: int) -> BatchChoice:
        return cls(size, False, "given (max_batch_size)")

    def record(self) -> dict[str, Any]:
        """What stats.json says of it."""
        return {"max_batch_size": self.size, "max_batch_size_chosen": self.chosen}


def decode_cost(
    target: Qwen3Shape, weight_bytes: int, element: int, kv_element: int, ceilings: Ceilings
) -> DecodeCost:
    """A decode step's parts at the device's rates: the weights read once, each K/V token of
    the paged layers read, each row's matmuls two FLOPs a weight (a MoE's every expert: an
    upper bound, so a batch stops no later than it should)."""
    kv_per_token = paged_layers(target) * 2 * target.num_kv_heads * target.head_dim * kv_element
    return DecodeCost.roofline(
        weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_per_token,
        flops_per_row=2 * weight_bytes / element,
        bytes_per_s=ceilings.copy_bytes_per_s,
        flops_per_s=ceilings.matmul_rate(target),
    )


def rule_applies(given: int | None, device: torch.device) -> bool:
    """Whether the batch comes from the rule (and needs the rows' length): none given, on a
    GPU. Otherwise nothing reads the input for it."""
    return given is None and device.type == "cuda"


def choose_batch(
    given: int | None,
    device: torch.device,
    rows: RowTokens,
    cost: Callable[[], DecodeCost],
    pages_at: Callable[[int], int],
    page_size: int,
) -> BatchChoice:
    """The given batch; else on a CPU CPU_BATCH_SIZE, on a GPU the rule's (cost: measures the
    device's rates, asked only here)."""
    if not rule_applies(given, device):
        if given is not None:
            return BatchChoice.given(given)
        return BatchChoice(CPU_BATCH_SIZE, True, "chosen: a CPU's fixed batch")
    size = default_batch_size(cost(), rows.prompt, rows.output, pages_at, page_size)
    why = (
        f"chosen from memory and step cost for rows of {rows.prompt} + {rows.output} tokens "
        f"({rows.source})"
    )
    return BatchChoice(size, True, why)


def job_batch(
    config: EngineConfig,
    target: Qwen3Shape,
    draft: DraftLayout | None,
    dtype: torch.dtype,
    device: torch.device,
    weight_bytes: int,
    rows: RowTokens,
    memory: tuple[int, int] | None = None,
) -> BatchChoice:
    """choose_batch for a job's engine: its given batch, or the rule's at the device's rates
    (measured now, on a GPU) over the pages job_kv_pages sizes for each batch tried (memory: as
    kv_pages's; preflight's: the weights' bytes in use before they load). weight_bytes: what a
    decode step reads, the target's and the draft's (this rank's)."""
    kv_element = kv_element_size(config.kv_cache_dtype, dtype.itemsize)
    return choose_batch(
        config.max_batch_size,
        device,
        rows,
        lambda: decode_cost(
            target, weight_bytes, dtype.itemsize, kv_element, _measured(dtype, device)
        ),
        lambda batch: job_kv_pages(
            replace(config, max_batch_size=batch), target, draft, dtype, device, memory
        ),
        config.page_size,
    )


def _measured(dtype: torch.dtype, device: torch.device) -> Ceilings:
    """The device's rates; a device without the 2 GiB the measurement takes refuses the job in
    one line (a given batch measures nothing)."""
    try:
        return measure_ceilings(dtype, device)
    except torch.OutOfMemoryError:
        raise JobError(
            f"{device} has no 2 GiB free to measure its rates for the default batch; "
            "set --max-batch-size"
        ) from None

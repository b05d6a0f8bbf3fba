"""The model families batchrun loads as a target, declared once: by config.json's model_type,
where the text model's keys are, how its shape is read, which model class runs it, and how its
checkpoint's tensors map onto that model (a prefix to drop, parts not run, a relayout)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from batchrun.errors import JobError
from batchrun.models.qwen3 import Qwen3ForCausalLM, Qwen3Shape
from batchrun.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5Shape
from batchrun.models.qwen3_next_weights import qwen3_next_weights
from batchrun.models.shapes import hybrid_shape, shape_of

Tensors = Iterator[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Family:
    shape: Callable[[Mapping[str, Any], str], Qwen3Shape]  # checked settings -> shape
    model: type[Qwen3ForCausalLM]
    # A multimodal checkpoint: its text model's keys under text_config, of this model_type.
    text_type: str | None = None
    prefix: str = ""  # the text model's tensors' prefix in place of "model."
    skipped: tuple[tuple[str, str], ...] = ()  # (tensor name prefix, what it is): not run
    relayout: Callable[[Tensors, Any], Tensors] | None = None  # (tensors, shape) -> tensors


_MULTIMODAL = (("model.visual.", "the vision tower"), ("mtp.", "the MTP head"))
FAMILIES = {
    "qwen3": Family(shape_of, Qwen3ForCausalLM),
    "qwen3_moe": Family(shape_of, Qwen3ForCausalLM),
    "llama": Family(shape_of, Qwen3ForCausalLM),  # Qwen3 without the q/k norm (shape.qk_norm)
    "qwen3_5_text": Family(hybrid_shape, Qwen3_5ForCausalLM, skipped=_MULTIMODAL[1:]),
    "qwen3_5_moe_text": Family(hybrid_shape, Qwen3_5ForCausalLM, skipped=_MULTIMODAL[1:]),
    "qwen3_5": Family(
        hybrid_shape, Qwen3_5ForCausalLM, "qwen3_5_text", "model.language_model.", _MULTIMODAL
    ),
    "qwen3_5_moe": Family(
        hybrid_shape, Qwen3_5ForCausalLM, "qwen3_5_moe_text", "model.language_model.", _MULTIMODAL
    ),
    "qwen3_next": Family(
        hybrid_shape, Qwen3_5ForCausalLM, skipped=_MULTIMODAL[1:], relayout=qwen3_next_weights
    ),
}


def family_of(config: Mapping[str, Any], where: str) -> tuple[Family, dict[str, Any]]:
    """(the family, its text model's config) of config.json; JobError in one line for a
    model_type batchrun does not run or a missing text_config."""
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise JobError(
            f"{where}: model_type is {model_type!r}; batchrun runs {', '.join(FAMILIES)}"
        )
    if family.text_type is None:
        return family, dict(config)
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise JobError(f"{where}: {model_type} needs a text_config object")
    # Keys transformers reads at the top of a multimodal config (tie_word_embeddings, ...)
    # hold where the text config leaves them out.
    merged = {k: v for k, v in config.items() if k in ("tie_word_embeddings",)} | text
    return family, merged | {"model_type": family.text_type}


def text_weights(family: Family, tensors: Tensors) -> tuple[Tensors, list[str]]:
    """(the text model's tensors under the model's names, the list it fills as it goes with
    what it skipped, one entry per skipped part). An FP8 checkpoint's scales keep their
    weights' names; the relayout comes after dequantization."""
    skipped: list[str] = []

    def mapped() -> Tensors:
        for name, tensor in tensors:
            part = next((what for prefix, what in family.skipped if name.startswith(prefix)), None)
            if part is not None:
                if part not in skipped:
                    skipped.append(part)
                continue
            if family.prefix and name.startswith(family.prefix):
                name = "model." + name.removeprefix(family.prefix)
            yield name, tensor

    return mapped(), skipped


def is_hybrid(shape: Qwen3Shape) -> bool:
    """Whether the model has linear-attention layers (per-request state slots)."""
    return isinstance(shape, Qwen3_5Shape) and bool(shape.linear_layers)


def paged_layers(shape: Qwen3Shape) -> int:
    """The target's layers whose K/V lives in the paged pool: all of a Qwen3's, a hybrid's
    full-attention ones (its linear layers keep per-request state slots instead)."""
    linear = shape.linear_layers if isinstance(shape, Qwen3_5Shape) else ()
    return shape.num_layers - len(linear)

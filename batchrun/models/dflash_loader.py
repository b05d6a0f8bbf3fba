"""Check that a DFlash draft (z-lab or speculators format) fits its target from its config and
tensor headers alone, then load it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from batchrun.errors import JobError
from batchrun.layers.rotary import RotaryEmbedding
from batchrun.models.block_attention import BlockAttention
from batchrun.models.config_check import checked_config
from batchrun.models.dflash import DFlashDraft, default_target_layer_ids
from batchrun.models.dflash_formats import ZLAB_ARCHITECTURE, DraftConfig, draft_config
from batchrun.models.header_weights import header_weights
from batchrun.models.loader import (
    checkpoint_weights,
    config_file,
    load_weights,
    read_config,
    release_staging,
)
from batchrun.models.meta import shapes_only
from batchrun.models.qwen3 import Qwen3ForCausalLM, Qwen3Shape
from batchrun.models.shapes import shape_of

VOCAB_MAPS = ("d2t", "t2d")


@dataclass(frozen=True)
class DraftSpec:
    """A draft as its config.json and tensor headers describe it, checked to fit its target."""

    shape: Qwen3Shape
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    attention: BlockAttention
    format: str
    # Rows of the draft's own lm_head (None: it uses the target's), and whether they are a
    # reduced vocabulary mapped to target ids through d2t (and t2d where given).
    head_rows: int | None = None
    vocab_map: bool = False
    not_loaded: frozenset[str] = frozenset()  # tensors the checkpoint carries but batchrun skips


def check_draft(
    draft_dir: Path, target: Qwen3Shape, architecture: str = ZLAB_ARCHITECTURE
) -> DraftSpec:
    """Every check of a draft against its target that needs no weights: its config.json and
    the tensor names and shapes in its safetensors headers. architecture: the z-lab config's
    (draft_config). Raises JobError."""
    config = read_config(draft_dir, "draft")
    fields = draft_config(config, f"draft: {config_file(draft_dir)}", architecture)
    layers = checked_config(fields.layers, fields.layers_where)
    shape = shape_of(layers, "draft")
    if shape.hidden_size != target.hidden_size:
        raise JobError(
            f"draft: hidden_size {shape.hidden_size} does not match the target's "
            f"{target.hidden_size}"
        )
    if shape.vocab_size != target.vocab_size:
        raise JobError(
            f"draft: vocab_size {shape.vocab_size} does not match the target's {target.vocab_size}"
        )
    block_size = fields.block_size  # its type and range: config_check's tables
    if block_size is None:
        raise JobError("draft: block_size is missing")
    mask_id = fields.mask_token_id
    if mask_id is None:
        raise JobError("draft: mask_token_id is missing")
    if not 0 <= mask_id < target.vocab_size:
        raise JobError(
            f"draft: mask_token_id {mask_id} is outside the target's embedding "
            f"({target.vocab_size} rows)"
        )
    tensors = tensor_shapes(draft_dir)
    head_rows, vocab_map = _check_vocabulary(fields, tensors, target)
    return DraftSpec(
        shape=shape,
        target_layer_ids=_target_layer_ids(fields, shape, target),
        block_size=block_size,
        mask_token_id=mask_id,
        attention=_block_attention(fields, layers, block_size),
        format=fields.format,
        head_rows=head_rows,
        vocab_map=vocab_map,
        not_loaded=(fields.verifier_tensors | set(VOCAB_MAPS)) & tensors.keys(),
    )


def _target_layer_ids(
    fields: DraftConfig, shape: Qwen3Shape, target: Qwen3Shape
) -> tuple[int, ...]:
    ids, base = fields.layer_ids, fields.layer_id_base
    if ids is None:
        n_target = fields.num_target_layers or target.num_layers
        return tuple(default_target_layer_ids(shape.num_layers, n_target))
    top = target.num_layers - 1 + base
    ok = isinstance(ids, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and base <= i <= top for i in ids
    )
    if not ok or not ids:
        raise JobError(
            f"draft: {fields.layer_ids_key} {ids} must be layers of the target ({base}..{top})"
        )
    return tuple(i - base for i in ids)


def _block_attention(
    fields: DraftConfig, layers: Mapping[str, Any], block_size: int
) -> BlockAttention:
    """Which layers slide: `layer_types` of checked_config's settings, which read them as
    transformers' Qwen3Config does (`sliding_window` counts only with `use_sliding_window`;
    without layer_types, the layers from `max_window_layers` on slide when there is a window).
    Llama layers (LlamaConfig has no window) all attend in full."""
    window = layers.get("sliding_window")
    types = layers.get("layer_types") or ["full_attention"] * layers["num_hidden_layers"]
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise JobError(f"draft: layer type {unknown[0]!r} is not supported")
    if len(types) != layers["num_hidden_layers"]:
        raise JobError(
            f"draft: layer_types names {len(types)} layers, not {layers['num_hidden_layers']}"
        )
    sliding = tuple(t == "sliding_attention" for t in types)
    if not any(sliding):
        return BlockAttention(sliding, None, fields.full_causal, fields.sliding_causal)
    if window is None:
        raise JobError(
            "draft: layer_types has sliding_attention layers but no window "
            "(sliding_window with use_sliding_window: true)"
        )
    if window < block_size:
        raise JobError(
            f"draft: sliding_window {window!r} smaller than the block size {block_size} is "
            "not supported"
        )
    return BlockAttention(sliding, window, fields.full_causal, fields.sliding_causal)


def _check_vocabulary(
    fields: DraftConfig, tensors: dict[str, list[int]], target: Qwen3Shape
) -> tuple[int | None, bool]:
    """(rows of the draft's own lm_head or None, whether d2t maps them to target ids)."""
    vocab = fields.draft_vocab_size
    vocab = target.vocab_size if vocab is None else vocab
    if not isinstance(vocab, int) or not 1 <= vocab <= target.vocab_size:
        raise JobError(
            f"draft: draft_vocab_size must be an integer in 1 .. {target.vocab_size} (the "
            f"target's vocabulary), got {vocab!r}"
        )
    reduced = vocab < target.vocab_size
    head = tensors.get("lm_head.weight")
    if head is None and reduced:
        raise JobError(f"draft: draft_vocab_size {vocab} needs the draft's own lm_head.weight")
    if head is not None and head != [vocab, target.hidden_size]:
        raise JobError(
            f"draft: lm_head.weight has shape {head}, expected {[vocab, target.hidden_size]}"
        )
    if not reduced:
        return (vocab if head is not None else None), False
    expected = {"d2t": [vocab], "t2d": [target.vocab_size]}
    if "d2t" not in tensors:
        raise JobError(f"draft: draft_vocab_size {vocab} needs the d2t map to target ids")
    for name in VOCAB_MAPS:
        if name in tensors and tensors[name] != expected[name]:
            raise JobError(f"draft: {name} has shape {tensors[name]}, expected {expected[name]}")
    return vocab, True


def check_draft_weights(
    draft_dir: Path, spec: DraftSpec, vocab_size: int, dtype: torch.dtype
) -> int:
    """load_weights's checks of the draft's weights' names and shapes, on a draft built on the
    meta device against the tensors its safetensors headers describe, so no weight is read (but
    its small vocabulary map, as the loader checks it). Returns the bytes its weights take in
    `dtype`. Raises JobError."""
    with shapes_only():
        module = DFlashDraft(
            spec.shape,
            list(spec.target_layer_ids),
            spec.block_size,
            spec.mask_token_id,
            1,
            spec.attention,
            spec.head_rows,
        ).to(dtype)
    tensors = header_weights(draft_dir, spec.shape, "draft")
    load_weights(module, tensors, "draft", skip=set(spec.not_loaded))
    if spec.vocab_map and spec.head_rows is not None:
        _draft_to_target(draft_dir, spec.head_rows, vocab_size)
    return sum(p.numel() * p.element_size() for p in module.parameters())


def load_dflash(
    draft_dir: Path, target: Qwen3ForCausalLM, device: torch.device, max_positions: int
) -> DFlashDraft:
    spec = check_draft(draft_dir, target.shape)
    shape = spec.shape
    dtype = target.lm_head.weight.dtype
    with shapes_only():
        draft = DFlashDraft(
            shape,
            list(spec.target_layer_ids),
            spec.block_size,
            spec.mask_token_id,
            max_positions,
            spec.attention,
            spec.head_rows,
        ).to(dtype)
    draft.to_empty(device=device)
    tensors = checkpoint_weights(draft_dir, shape, device, "draft")
    load_weights(draft, tensors, "draft", skip=set(spec.not_loaded))
    release_staging(device)
    draft.rope = RotaryEmbedding(
        shape.head_dim, max_positions, shape.rope_theta, shape.rope_scaling
    ).to(device)
    draft.draft_to_target = (
        _draft_to_target(draft_dir, spec.head_rows, target.shape.vocab_size).to(device)
        if spec.vocab_map and spec.head_rows is not None
        else None  # the draft's tokens are the target's
    )
    draft.pack_context_kv()
    return draft.eval()


def _draft_to_target(draft_dir: Path, rows: int, vocab_size: int) -> torch.Tensor:
    """The target id of each draft token: d2t holds offsets (EAGLE-3's convention, as in vLLM
    and speculators), target id = draft id + d2t[draft id]; t2d, where given, must mark
    exactly those target ids."""
    tensors = _read_tensors(draft_dir, VOCAB_MAPS)
    to_target = torch.arange(rows) + tensors["d2t"].long()
    if int(to_target.min()) < 0 or int(to_target.max()) >= vocab_size:
        raise JobError(f"draft: d2t maps draft tokens outside the target's {vocab_size} ids")
    if "t2d" in tensors:
        marked = tensors["t2d"].bool()
        mapped = torch.zeros(vocab_size, dtype=torch.bool)
        mapped[to_target] = True
        if not torch.equal(marked, mapped):
            raise JobError("draft: t2d does not mark the target ids that d2t maps to")
    return to_target


def tensor_shapes(model_dir: Path) -> dict[str, list[int]]:
    """The tensor names and shapes of a checkpoint, read from the safetensors headers alone."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise JobError(f"no .safetensors files in {model_dir}")
    shapes: dict[str, list[int]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    shapes[name] = list(f.get_slice(name).get_shape())
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise JobError(f"cannot read {file}: {e}".splitlines()[0]) from None
    return shapes


def _read_tensors(model_dir: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The named tensors of a checkpoint (those it has), read without the others."""
    found: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            found |= {name: f.get_tensor(name) for name in names if name in f.keys()}  # noqa: SIM118
    return found

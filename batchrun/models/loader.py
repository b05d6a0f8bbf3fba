"""Load Hugging Face Qwen3 checkpoint directories into batchrun's own modules."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchrun.errors import JobError
from batchrun.layers.fp8_linear import Fp8Linear
from batchrun.layers.rotary import RotaryEmbedding
from batchrun.models.config_check import checked_config
from batchrun.models.families import family_of, is_hybrid, text_weights
from batchrun.models.fp8 import SCALE_SUFFIX, dequantized
from batchrun.models.meta import shapes_only
from batchrun.models.qwen3 import Qwen3ForCausalLM, Qwen3Shape
from batchrun.models.qwen3_sharding import TensorParallelQwen3, shard_checkpoint
from batchrun.models.safetensors_reader import read_safetensors
from batchrun.parallel.group import TensorParallel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def config_file(model_dir: Path) -> Path:
    return model_dir / "config.json"


def read_config(model_dir: Path, what: str = "model") -> dict[str, Any]:
    path = config_file(model_dir)
    if not model_dir.is_dir():
        raise JobError(f"{what} directory not found: {model_dir}")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise JobError(f"{what} directory has no config.json: {model_dir}") from None
    except (OSError, ValueError) as e:
        raise JobError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise JobError(f"{path} holds {type(config).__name__}, not a JSON object")
    return config


def qwen3_shape(
    config: Mapping[str, Any], what: str = "target", source: Path | str = "config.json"
) -> Qwen3Shape:
    """The model a config of one of the families (models/families.py) describes; `source` is
    where its keys are, for the errors (config_check.checked_config's)."""
    where = f"{what}: {source}"
    family, text = family_of(config, where)
    return family.shape(checked_config(text, where), what)


def resolve_dtype(name: str, config: dict[str, Any], device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in half precision are slow and inexact
    # On the GPU, a checkpoint stored in float32 still runs in bfloat16 unless asked otherwise.
    stored = str(config.get("dtype") or config.get("torch_dtype"))
    return torch.float16 if stored == "float16" else torch.bfloat16


def iter_safetensors(
    model_dir: Path, device: torch.device | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, file by file, each file's in file order. On a CUDA
    device they are read straight onto it (one file's data at a time), else onto the CPU.
    Call release_staging after loading from a CUDA device."""
    for file in safetensors_files(model_dir):
        yield from read_safetensors(file, device)


def checkpoint_weights(
    model_dir: Path,
    shape: Qwen3Shape,
    device: torch.device | None,
    what: str,
    model: nn.Module | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """iter_safetensors, with an FP8 checkpoint's weights dequantized (models/fp8.py) but those
    that `model` keeps in FP8."""
    return fp8_weights(iter_safetensors(model_dir, device), shape, what, model)


def fp8_weights(
    tensors: Iterator[tuple[str, torch.Tensor]],
    shape: Qwen3Shape,
    what: str,
    model: nn.Module | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """An FP8 checkpoint's tensors as `model` loads them: the weights of its Fp8Linear layers
    with their scales, every other FP8 weight dequantized."""
    if shape.fp8 is None:
        return tensors
    if model is None:
        return dequantized(tensors, shape.fp8, what)
    fp8_params = {
        f"{path}.weight" for path, layer in model.named_modules() if isinstance(layer, Fp8Linear)
    }

    def kept(name: str) -> bool:
        packed = packed_target(model, name)
        return (packed[0] if packed is not None else name) in fp8_params

    return dequantized(tensors, shape.fp8, what, kept)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files, in load order; JobError when there are none."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise JobError(f"no .safetensors files in {model_dir}")
    return files


def release_staging(device: torch.device) -> None:
    """Hand the reader's per-file device buffers, which torch keeps cached, back to the driver:
    the KV pools are sized by the memory reserved once the models are loaded."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def packed_target(module: nn.Module, name: str) -> tuple[str, int] | None:
    """(packed parameter name, shard index) of a checkpoint tensor that a layer packs with
    others (q/k/v, gate/up), else None (also for a name whose path is no submodule: the
    loader reports it as unexpected)."""
    *path, proj, leaf = name.split(".")
    if not path:
        return None
    try:
        owner = module.get_submodule(".".join(path))
    except AttributeError:
        return None
    packed = getattr(type(owner), "PACKED", {}).get(proj)
    return (".".join([*path, packed[0], leaf]), packed[1]) if packed else None


def load_weights(
    module: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], what: str, skip: set[str]
) -> None:
    """Copy checkpoint tensors into the module's parameters, by name, checking every shape;
    packed parameters take each of their checkpoint tensors as a slice of rows."""
    params = dict(module.named_parameters())
    missing = {(name, 0) for name in params}
    for name in params:
        shards = _shard_sizes(module, name)
        if shards is not None:
            missing |= {(name, i) for i in range(len(shards))}
    for name, tensor in tensors:
        if name in skip:
            continue
        packed = packed_target(module, name)
        target, shard = packed if packed is not None else (name, 0)
        param = params.get(target)
        if param is None:
            raise JobError(f"{what}: unexpected tensor {name!r} in the checkpoint")
        dest: torch.Tensor = param
        if packed is not None:
            sizes = _shard_sizes(module, target) or ()
            start = sum(sizes[:shard])
            dest = param[start : start + sizes[shard]]
        if dest.shape != tensor.shape:
            raise JobError(
                f"{what}: tensor {name!r} has shape {list(tensor.shape)}, "
                f"expected {list(dest.shape)}"
            )
        with torch.no_grad():
            dest.copy_(tensor)
        missing.discard((target, shard))
    if missing:
        name = sorted(missing)[0][0]
        raise JobError(f"{what}: checkpoint lacks {name!r} ({len(missing)} missing)")


def checkpoint_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters under checkpoint names: packed ones split back into their
    tensors (views, no copies). The inverse of load_weights."""
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        sizes = _shard_sizes(module, name)
        if sizes is None:
            out[name] = param
            continue
        layer_path, packed, leaf = name.rsplit(".", 2)
        layer = module.get_submodule(layer_path)
        packing: dict[str, tuple[str, int]] = getattr(type(layer), "PACKED")  # noqa: B009
        shards = sorted((i, n) for n, (p, i) in packing.items() if p == packed)
        for (_, shard_name), part in zip(shards, param.split(list(sizes)), strict=True):
            out[f"{layer_path}.{shard_name}.{leaf}"] = part
    return out


def _owner(module: nn.Module, param_name: str) -> Any:
    """The submodule holding a parameter (shard_sizes is set on packed linear layers)."""
    return module.get_submodule(param_name.rpartition(".")[0])


def _shard_sizes(module: nn.Module, param_name: str) -> tuple[int, ...] | None:
    """The rows each packed checkpoint tensor takes in a packed parameter, else None (an FP8
    layer's scales: its blocks of rows)."""
    owner = _owner(module, param_name)
    if param_name.endswith(SCALE_SUFFIX):
        return owner.shard_scale_rows or None
    return getattr(owner, "shard_sizes", None)


def target_weights(
    tensors: Iterator[tuple[str, torch.Tensor]],
    config: Mapping[str, Any],
    shape: Qwen3Shape,
    model: nn.Module,
) -> tuple[Iterator[tuple[str, torch.Tensor]], list[str]]:
    """A target checkpoint's tensors as `model` loads them (its family's text model, FP8
    weights it does not keep dequantized, relaid out), and the list of the parts it skipped
    (the vision tower, ...), filled as they are read."""
    family, _ = family_of(config, "target")
    named, skipped = text_weights(family, tensors)
    out = fp8_weights(named, shape, "target", model)
    return (out if family.relayout is None else family.relayout(out, shape)), skipped


def load_qwen3(
    model_dir: Path,
    dtype: str,
    device: torch.device,
    rope_headroom: int = 0,
    tp: TensorParallel | None = None,
) -> tuple[Qwen3ForCausalLM, dict[str, Any]]:
    """The target; with tp, this tensor-parallel rank's share of it."""
    config = read_config(model_dir, "target model")
    shape = qwen3_shape(config, "target", config_file(model_dir))
    family, _ = family_of(config, "target")
    if tp is not None and is_hybrid(shape):
        raise JobError("target: tensor parallelism (--tp) does not run hybrid targets yet")
    torch_dtype = resolve_dtype(dtype, config, device)
    with shapes_only():
        model = family.model(shape) if tp is None else TensorParallelQwen3(shape, tp)
        model = model.to(torch_dtype)
    model.to_empty(device=device)  # no random init: every parameter is loaded below
    if shape.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    skip = {"lm_head.weight"} if shape.tie_word_embeddings else set()
    tensors, _ = target_weights(iter_safetensors(model_dir, device), config, shape, model)
    load_weights(model, tensors if tp is None else shard_checkpoint(tensors, tp), "target", skip)
    release_staging(device)
    model.pack_experts()
    # Buffers are not in the checkpoint: build the RoPE table for real, in float32.
    model.rope = RotaryEmbedding(
        shape.rotary_dim,
        shape.max_position_embeddings + rope_headroom,
        shape.rope_theta,
        shape.rope_scaling,
    ).to(device)
    return model.eval(), config

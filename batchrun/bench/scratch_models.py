"""Random-weight checkpoints at a real model's shape, written to a scratch directory so that
whole jobs (`batchrun run --target DIR --draft DIR`) run on them exactly as on a real model.

The target is a Hugging Face Qwen3 directory (safetensors shards of at most 5 GB with
transformers' index, config.json, generation_config.json), or for a hybrid shape Qwen3.5's text
model (`qwen3_5_text`: the published checkpoints' language model without their vision tower and
MTP head, which batchrun does not run), and a byte-level tokenizer covering its whole vocabulary
(the 256 bytes, then "t256" .. "t{V-1}"); the draft is a DFlash draft in z-lab's layout. Weights
are drawn on `device` in `dtype` (the 8B's 16 GB take seconds on a GPU) and copied to the host
one shard at a time; tiny shapes on the CPU serve the tests.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from batchrun.bench.shapes import DRAFT_BLOCK, DRAFT_LAYERS, _randomize, model_class
from batchrun.models.dflash import DFlashDraft, default_target_layer_ids
from batchrun.models.dflash_formats import ZLAB_ARCHITECTURE
from batchrun.models.loader import checkpoint_tensors, qwen3_shape
from batchrun.models.meta import shapes_only
from batchrun.models.qwen3 import Qwen3ForCausalLM, Qwen3Shape
from batchrun.models.qwen3_5 import Qwen3_5Shape
from batchrun.tools.tiny_draft import draft_config

MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size, "5GB"
MARKER = "scratch.json"  # written last: a directory without it is incomplete
QWEN3_EOS = 151645  # <|im_end|>, Qwen3's eos


def eos_id(vocab_size: int) -> int:
    """The eos id: Qwen3's own (151645) where the vocabulary holds it, else the last id. The
    tokenizer's f"t{eos_id}" is its eos (and pad) token."""
    return QWEN3_EOS if vocab_size > QWEN3_EOS else vocab_size - 1


def mask_id(vocab_size: int) -> int:
    """The draft's mask token: the last id, or the one before it where that is the eos. Every
    row of the vocabulary is a token, so there is no unused row to take (real Qwen3
    drafts use the padded row 151669); the mask only needs to differ from the eos."""
    last = vocab_size - 1
    return last if last != eos_id(vocab_size) else last - 1


def write_target(
    out_dir: Path | str,
    shape: Qwen3Shape,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    echo: bool = False,
) -> Path:
    """A random checkpoint of the shape's family with its tokenizer; seed 0 gives
    shapes.random_target's weights: norms the identity, every other weight normal with std
    0.02. echo: see _echo."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Allocated uninitialised on the device in dtype (no float32 copy, no default init):
    # _randomize writes every parameter.
    with shapes_only():
        model = model_class(shape)(shape).to(dtype)
    model.to_empty(device=device)
    if shape.tie_word_embeddings:  # to_empty unties them; tied, lm_head is not in a checkpoint
        model.lm_head.weight = model.model.embed_tokens.weight
    _randomize(model, seed)
    if echo:
        _echo(model)
    _write_shards(out, "model", checkpoint_tensors(model), max_shard_bytes)
    del model

    eos = eos_id(shape.vocab_size)
    name = _dtype_name(dtype)
    common: dict[str, Any] = dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rms_norm_eps=shape.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
        eos_token_id=eos,
        pad_token_id=eos,
        dtype=name,
    )
    config: PretrainedConfig
    if isinstance(shape, Qwen3_5Shape):
        config = _hybrid_config(shape, common)
    elif shape.num_experts:
        config = Qwen3MoeConfig(
            **common,
            num_experts=shape.num_experts,
            num_experts_per_tok=shape.num_experts_per_tok,
            moe_intermediate_size=shape.moe_intermediate_size,
            norm_topk_prob=shape.norm_topk_prob,
            decoder_sparse_step=shape.decoder_sparse_step,
            mlp_only_layers=list(shape.mlp_only_layers),
            architectures=["Qwen3MoeForCausalLM"],
        )
    else:
        config = Qwen3Config(**common, architectures=["Qwen3ForCausalLM"])
    config.save_pretrained(str(out))
    if shape.fp8 is not None:  # as Qwen's -FP8 checkpoints say it
        written = json.loads((out / "config.json").read_text())
        written["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(shape.fp8.block) if shape.fp8.block else None,
        }
        (out / "config.json").write_text(json.dumps(written, indent=2))
    GenerationConfig(eos_token_id=eos, pad_token_id=eos).save_pretrained(str(out))
    write_tokenizer(out, shape.vocab_size, eos)
    return out


def _hybrid_config(shape: Qwen3_5Shape, common: dict[str, Any]) -> PretrainedConfig:
    """Qwen3.5's text config (dense: the MoE hybrids have no bench shape)."""
    rope = common["rope_parameters"] | {"partial_rotary_factor": shape.partial_rotary_factor}
    return Qwen3_5TextConfig(
        **(common | {"rope_parameters": rope}),
        layer_types=list(shape.layer_types),
        linear_conv_kernel_dim=shape.linear_conv_kernel,
        linear_num_key_heads=shape.linear_num_key_heads,
        linear_num_value_heads=shape.linear_num_value_heads,
        linear_key_head_dim=shape.linear_key_head_dim,
        linear_value_head_dim=shape.linear_value_head_dim,
        architectures=["Qwen3_5ForCausalLM"],
    )


ECHO_SCALE = 5000.0  # embeddings of std 100 against what 36 layers of std-0.02 weights add (~15)


def _echo(model: Qwen3ForCausalLM) -> None:
    """Embeddings that dominate the residual stream and an untied head holding them unscaled:
    greedy decoding repeats the prompt's last token by a logit margin near 80 (the rest of the
    vocabulary: a few units), so no rounding decides a token and bf16 batches of any shape give
    the same outputs, which the job benchmark's acceptance oracle replays. Every matmul keeps
    its shape and cost."""
    if model.shape.tie_word_embeddings:
        raise ValueError("an echo checkpoint needs an untied head")
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        model.lm_head.weight.copy_(embed)
        embed.mul_(ECHO_SCALE)


def write_tokenizer(out_dir: Path | str, vocab_size: int, eos_id: int) -> None:
    """A byte-level tokenizer covering the vocabulary: ids 0 .. 255 are the 256 bytes, so any
    text encodes (byte by byte) and a grammar (structured outputs) can spell anything, as with
    a real model's tokenizer; every other id i decodes to the text f"t{i}"."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[:vocab_size]
    vocab = {char: i for i, char in enumerate(alphabet)}
    vocab |= {f"t{i}": i for i in range(len(alphabet), vocab_size)}
    backend = Tokenizer(models.BPE(vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    eos = f"t{eos_id}" if eos_id >= len(alphabet) else alphabet[eos_id]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=eos, pad_token=eos, clean_up_tokenization_spaces=False
    )
    tokenizer.save_pretrained(str(out_dir))


# A selector drafter's own dflash_config keys, as z-lab's published one has them
# (z-lab/dflash tests/fixtures: docs/dflash.md section 8).
SELECTOR_KEYS = {
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "selector_rank": 256,
    "selector_top_k": 16,
    "final_logit_softcapping": 20.0,
}


def write_draft(
    out_dir: Path | str,
    target_dir: Path | str,
    *,
    num_layers: int = DRAFT_LAYERS,
    block_size: int = DRAFT_BLOCK,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 1,
    target_layer_ids: list[int] | None = None,
    architecture: str = ZLAB_ARCHITECTURE,
) -> Path:
    """A random DFlash draft (z-lab's config and tensor names, one safetensors file) for the
    target in target_dir. target_layer_ids None: batchrun's default ids (z-lab's 1, 9, 17, 25,
    33 for 5 layers over 36), always written into the config. Another `architecture` (a
    method's, spec_decode/registry.py) gets the convolutions and candidate selector of
    z-lab's DFlash2DraftModel layout besides."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = json.loads((Path(target_dir) / "config.json").read_text())
    layer_ids = target_layer_ids or default_target_layer_ids(
        num_layers, target["num_hidden_layers"]
    )
    dflash = {"mask_token_id": mask_id(target["vocab_size"]), "target_layer_ids": layer_ids}
    if architecture != ZLAB_ARCHITECTURE:
        dflash |= SELECTOR_KEYS
    config = draft_config(target, num_layers, block_size, dflash) | {"dtype": _dtype_name(dtype)}
    if architecture != ZLAB_ARCHITECTURE:  # the published selector drafter's block attention
        config |= {"architectures": [architecture], "is_causal": False}
    # batchrun's draft module, built from that very config, carries z-lab's tensor names.
    with shapes_only():
        draft = DFlashDraft(qwen3_shape(config, "draft"), layer_ids, block_size, 0, block_size)
    draft = draft.to(dtype).to_empty(device=device)
    _randomize(draft, seed)
    tensors = checkpoint_tensors(draft)
    if architecture != ZLAB_ARCHITECTURE:
        tensors |= _selector_tensors(config, dtype, torch.device(device), seed)
    _write_shards(out, "model", tensors, max_shard_bytes=None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _selector_tensors(
    config: dict[str, Any], dtype: torch.dtype, device: torch.device, seed: int
) -> dict[str, torch.Tensor]:
    """The convolutions' and candidate selector's tensors (normal, std 0.02, as _randomize's)
    under z-lab's names and shapes."""
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    keys = config["dflash_config"]
    taps, rank = keys["conv_kernel_size"], keys["selector_rank"]
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(config["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{conv}.base_kernel"] = (2, taps, hidden)
            rows = 2 * taps * hidden // keys["conv_group_size"]
            shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (rows, hidden)
    shapes |= {
        "candidate_selector.hidden_projection.weight": (rank, hidden),
        "candidate_selector.predecessor_codebook": (vocab, rank),
        "candidate_selector.successor_codebook": (vocab, rank),
    }
    return {
        name: torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
        for name, shape in shapes.items()
    }


def write_scratch_models(
    root: Path | str,
    shape: Qwen3Shape,
    dtype: torch.dtype,
    device: torch.device | str,
    draft: bool = True,
    *,
    draft_layers: int = DRAFT_LAYERS,
    block_size: int = DRAFT_BLOCK,
    target_layer_ids: list[int] | None = None,
    echo: bool = False,
    draft_architecture: str = ZLAB_ARCHITECTURE,
) -> tuple[Path, Path | None]:
    """root/target and root/draft (None without draft; root/draft-<architecture> for another
    architecture than DFlash's, write_draft's). A directory whose marker records the same shape
    and settings is reused as it is; any other is deleted and written afresh."""
    root = Path(root)
    target_dir = root / "target"
    draft_name = (
        "draft" if draft_architecture == ZLAB_ARCHITECTURE else f"draft-{draft_architecture}"
    )
    draft_dir = root / draft_name
    target_key = {
        "shape": asdict(shape),
        "dtype": _dtype_name(dtype),
        "seed": 0,
        "echo": echo,
        "tokenizer": "bytes",  # a directory with the earlier word-level tokenizer is rewritten
    }
    _reuse_or_write(
        target_dir, target_key, lambda: write_target(target_dir, shape, dtype, device, echo=echo)
    )
    if not draft:
        return target_dir, None
    draft_key = {"target": target_key, "layers": draft_layers, "block_size": block_size}
    draft_key |= {"target_layer_ids": target_layer_ids, "seed": 1}
    if draft_architecture != ZLAB_ARCHITECTURE:
        draft_key |= {"architecture": draft_architecture, "selector": SELECTOR_KEYS}

    def write() -> Path:
        return write_draft(
            draft_dir,
            target_dir,
            num_layers=draft_layers,
            block_size=block_size,
            dtype=dtype,
            device=device,
            target_layer_ids=target_layer_ids,
            architecture=draft_architecture,
        )

    _reuse_or_write(draft_dir, draft_key, write)
    return target_dir, draft_dir


def _reuse_or_write(out: Path, key: dict[str, Any], write: Callable[[], Path]) -> None:
    marker = out / MARKER
    text = json.dumps({"version": 1, **key}, indent=2, sort_keys=True) + "\n"
    if marker.is_file() and marker.read_text() == text:
        return
    shutil.rmtree(out, ignore_errors=True)  # a killed run's half, or another shape's
    write()
    marker.write_text(text)


def _write_shards(
    out: Path, stem: str, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None
) -> None:
    """Safetensors files as transformers writes them: stem.safetensors when one holds it all,
    else stem-0000i-of-0000n.safetensors with stem.safetensors.index.json. Tensors fill shards
    in order; each shard is copied to the host only while it is written."""
    for old in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
        old.unlink()  # a stale shard would be loaded with the new ones
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    n = len(shards)
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        file = f"{stem}.safetensors" if n == 1 else f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors"
        # copy=True: packed q/k/v and gate/up views on the CPU would share memory, which
        # safetensors refuses.
        host = {k: tensors[k].detach().to("cpu", copy=True).contiguous() for k in names}
        save_file(host, str(out / file), metadata={"format": "pt"})
        del host
        weight_map |= dict.fromkeys(names, file)
    if n > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

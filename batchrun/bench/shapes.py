"""Real model shapes with random weights, built directly on the device (no checkpoint needed):
the target, a z-lab-shaped DFlash draft for it, and the same target as a transformers model."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import torch

from batchrun.attention.kv_dtype import FP8_MAX
from batchrun.layers.norm import ZeroCentredRMSNorm
from batchrun.layers.rotary import RotaryEmbedding
from batchrun.models.dflash import DFlashDraft, default_target_layer_ids
from batchrun.models.fp8 import SCALE_SUFFIX, Fp8Scheme
from batchrun.models.loader import checkpoint_tensors, load_weights
from batchrun.models.meta import shapes_only
from batchrun.models.qwen3 import Qwen3ForCausalLM, Qwen3Shape
from batchrun.models.qwen3_5 import FULL, LINEAR, Qwen3_5ForCausalLM, Qwen3_5Shape
from batchrun.models.qwen3_sharding import TensorParallelQwen3
from batchrun.parallel.group import TensorParallel

_QWEN3 = dict(
    vocab_size=151936,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
)
_QWEN3_5 = dict(
    vocab_size=248320,
    num_kv_heads=4,
    head_dim=256,
    rms_norm_eps=1e-6,
    rope_theta=10_000_000.0,
    max_position_embeddings=262144,
    tie_word_embeddings=False,
    partial_rotary_factor=0.25,
    linear_conv_kernel=4,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)
FULL_ATTENTION_INTERVAL = 4  # Qwen3.5's: every fourth layer attends over the paged KV


def hybrid_layers(num_layers: int) -> tuple[str, ...]:
    """Qwen3.5's layer_types: every FULL_ATTENTION_INTERVAL-th layer full, the rest linear."""
    return tuple(
        FULL if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else LINEAR for i in range(num_layers)
    )


SHAPES: dict[str, Qwen3Shape] = {
    "qwen3-4b": Qwen3Shape(
        hidden_size=2560,
        intermediate_size=9728,
        num_layers=36,
        num_heads=32,
        tie_word_embeddings=True,
        **_QWEN3,  # type: ignore[arg-type]
    ),
    "qwen3-8b": Qwen3Shape(
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        tie_word_embeddings=False,
        **_QWEN3,  # type: ignore[arg-type]
    ),
    "qwen3-32b": Qwen3Shape(
        hidden_size=5120,
        intermediate_size=25600,
        num_layers=64,
        num_heads=64,
        tie_word_embeddings=False,
        **_QWEN3,  # type: ignore[arg-type]
    ),
    "qwen3-30b-a3b": Qwen3Shape(
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        tie_word_embeddings=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        **{**_QWEN3, "num_kv_heads": 4},  # type: ignore[arg-type]
    ),
    # Qwen3.5's dense hybrids (Qwen3.6-27B keeps Qwen3.5-27B's shape): their published
    # config.json's text_config, three Gated DeltaNet layers to one of gated full attention.
    "qwen3.5-9b": Qwen3_5Shape(
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=32,
        layer_types=hybrid_layers(32),
        num_heads=16,
        linear_num_value_heads=32,
        **_QWEN3_5,  # type: ignore[arg-type]
    ),
    "qwen3.6-27b": Qwen3_5Shape(
        hidden_size=5120,
        intermediate_size=17408,
        num_layers=64,
        layer_types=hybrid_layers(64),
        num_heads=24,
        linear_num_value_heads=48,
        **_QWEN3_5,  # type: ignore[arg-type]
    ),
}
DRAFT_LAYERS = 5  # z-lab's Qwen3 DFlash drafts: 5 layers, block 16
DRAFT_BLOCK = 16


FP8_BLOCK = (128, 128)  # Qwen's -FP8 checkpoints
FP8_SPREAD = 64.0  # random FP8 weights: normal with this std, scaled back to std 0.02
FP8_SCALE = 0.02 / FP8_SPREAD  # their weight_scale_inv


def random_fp8(
    shape: torch.Size | tuple[int, ...],
    device: torch.device,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """float8_e4m3fn values drawn normal with std FP8_SPREAD (times FP8_SCALE: std 0.02)."""
    drawn = torch.empty(shape, device=device).normal_(generator=generator)
    return (drawn * FP8_SPREAD).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def shape_from_flags(name: str | None, fp8_weights: bool = False, **flags: Any) -> Qwen3Shape:
    """A preset, with any flag (hidden_size=..., num_layers=...) overriding it; fp8_weights:
    as Qwen's -FP8 checkpoint of it (128 x 128 blocks)."""
    base = SHAPES[name] if name else SHAPES["qwen3-8b"]
    if fp8_weights:
        base = replace(base, fp8=Fp8Scheme(FP8_BLOCK))
    shape = replace(base, **{k: v for k, v in flags.items() if v is not None})
    if isinstance(shape, Qwen3_5Shape):  # a layer count of its own keeps the 3 : 1 pattern
        shape = replace(shape, layer_types=hybrid_layers(shape.num_layers))
    return shape


def model_class(shape: Qwen3Shape) -> type[Qwen3ForCausalLM]:
    """The causal LM that runs the shape: the hybrid one for a Qwen3.5 shape."""
    return Qwen3_5ForCausalLM if isinstance(shape, Qwen3_5Shape) else Qwen3ForCausalLM


def qwen3_part(shape: Qwen3Shape) -> Qwen3Shape:
    """The shape's Qwen3 fields alone (a hybrid's widths, as its DFlash draft takes them)."""
    return Qwen3Shape(**{f.name: getattr(shape, f.name) for f in fields(Qwen3Shape)})


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Norms the identity (1, a zero-centred one's stored weight 0), every other weight normal
    with std 0.02 (FP8 ones: FP8_SPREAD times that, with scales that bring it back)."""
    device = next(module.parameters()).device
    # The meta device (a check that builds nothing) has no generator and needs none.
    gen = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)
    centred = {
        f"{name}.weight"
        for name, sub in module.named_modules()
        if isinstance(sub, ZeroCentredRMSNorm)
    }
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name in centred:
                param.zero_()
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
            elif param.dtype == torch.float8_e4m3fn:
                for rows in param.split(1024):  # no float32 copy of the whole weight
                    rows.copy_(random_fp8(rows.shape, device, gen))
            elif name.endswith(SCALE_SUFFIX):
                param.fill_(FP8_SCALE)
            else:
                param.normal_(0.0, 0.02, generator=gen)


def random_target(
    shape: Qwen3Shape, dtype: torch.dtype, device: torch.device, tp: TensorParallel | None = None
) -> Qwen3ForCausalLM:
    """With tp, only this rank's share is built (its own random weights; a Qwen3 shape)."""
    s = shape
    with shapes_only():  # allocated once, in dtype: a float32 build of a 30B model would not fit
        model = model_class(shape)(shape) if tp is None else TensorParallelQwen3(shape, tp)
        model = model.to(dtype)
    model.to_empty(device=device)
    if shape.tie_word_embeddings:  # to_empty unties them
        model.lm_head.weight = model.model.embed_tokens.weight
    _randomize(model, seed=0 if tp is None else tp.rank)
    model.pack_experts()
    # The RoPE table is built on the host (layers/rotary.py) and .to(dtype) rounded it: build it
    # again on the device, in float32, as the loader does.
    model.rope = RotaryEmbedding(
        s.rotary_dim, s.max_position_embeddings, s.rope_theta, s.rope_scaling
    ).to(device)
    return model.eval()


def random_draft(target: Qwen3ForCausalLM, shape: Qwen3Shape, max_positions: int) -> DFlashDraft:
    """shape: the target's whole shape (a tensor-parallel rank's model holds a share of its
    heads); the draft is whole, the same on every rank."""
    s = shape
    draft_shape = replace(  # dense Qwen3 layers, as z-lab's drafts of MoE and hybrid targets
        qwen3_part(s),
        num_layers=DRAFT_LAYERS,
        num_experts=0,
        num_experts_per_tok=0,
        moe_intermediate_size=0,
    )
    layer_ids = default_target_layer_ids(DRAFT_LAYERS, s.num_layers)
    device = target.lm_head.weight.device
    with torch.device(device):
        draft = DFlashDraft(draft_shape, layer_ids, DRAFT_BLOCK, 0, max_positions)
    draft.to(target.lm_head.weight.dtype)
    _randomize(draft, seed=1)
    draft.rope = RotaryEmbedding(s.head_dim, max_positions, s.rope_theta).to(device)
    draft.pack_context_kv()
    return draft.eval()


def hf_twin(model: Qwen3ForCausalLM) -> torch.nn.Module:
    """transformers' Qwen3ForCausalLM holding the same weights (the generate() baseline)."""
    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM as HFQwen3

    s = model.shape
    config = Qwen3Config(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        rms_norm_eps=s.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta},
        max_position_embeddings=s.max_position_embeddings,
        tie_word_embeddings=s.tie_word_embeddings,
    )
    dtype = model.lm_head.weight.dtype
    with shapes_only():
        hf = HFQwen3(config)
    hf = hf.to_empty(device=model.lm_head.weight.device)
    hf = hf.to(dtype)  # type: ignore[arg-type]
    load_weights(hf, iter(checkpoint_tensors(model).items()), "hf twin", skip=set())
    # Buffers are not parameters: build the RoPE table for real.
    rotary = type(hf.model.rotary_emb)
    hf.model.rotary_emb = rotary(config=config, device=model.lm_head.weight.device)
    return hf.eval()

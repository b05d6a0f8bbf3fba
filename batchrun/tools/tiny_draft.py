"""Write a tiny DFlash draft checkpoint (z-lab layout) for a tiny target, for tests and demos.

    python -m batchrun.tools.tiny_draft OUT_DIR --target DIR [--layers N] [--block-size B]
                                        [--layer-ids 0,2] [--mask-id N] [--seed S]

The draft has no embedding and no lm_head (it borrows the target's), so its shape is read from
the target's config.json; see docs/dflash.md section 1 for the format.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from batchrun.tools.tiny import DECISIVE_INIT


def make_tiny_draft(
    out_dir: Path | str,
    target_dir: Path | str,
    *,
    num_layers: int = 1,
    block_size: int = 4,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    seed: int = 0,
    state_dict: dict[str, torch.Tensor] | None = None,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Save a DFlash draft for the target in target_dir to out_dir and return out_dir.

    target_layer_ids None leaves the key out (loaders derive the default ids). mask_token_id
    None picks the first embedding row the tokenizer does not use, or the last row.
    state_dict is written as given instead of random weights (extra tensors included).
    extra_config's top-level keys overwrite the generated config (a dict replaces, it does not
    merge), so tests can write broken variants.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = json.loads((Path(target_dir) / "config.json").read_text())
    if mask_token_id is None:
        mask_token_id = unused_embedding_row(target_dir, int(target["vocab_size"]))
    dflash_config: dict[str, Any] = {"mask_token_id": mask_token_id}
    if target_layer_ids is not None:
        dflash_config["target_layer_ids"] = list(target_layer_ids)
    config = draft_config(target, num_layers, block_size, dflash_config)
    if state_dict is None:
        num_features = len(target_layer_ids) if target_layer_ids else num_layers
        state_dict = random_draft_weights(config, num_features, seed)
    config.update(extra_config or {})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: _stored(t) for name, t in state_dict.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _stored(tensor: torch.Tensor) -> torch.Tensor:
    """Float weights in float32 (the tiny target's dtype); other tensors (say an int d2t map in
    a broken variant) as they are."""
    tensor = tensor.detach().contiguous()
    return tensor.to(torch.float32) if tensor.is_floating_point() else tensor


def unused_embedding_row(target_dir: Path | str, vocab_size: int) -> int:
    """The first row of the target's embedding that no tokenizer token maps to, else the last.

    Real Qwen3 drafts use such a padded row (151669), so a mask id never collides with text.
    """
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    used = set(tokenizer.get_vocab().values())
    return next((i for i in range(vocab_size) if i not in used), vocab_size - 1)


def draft_config(
    target: dict[str, Any], num_layers: int, block_size: int, dflash_config: dict[str, Any]
) -> dict[str, Any]:
    """A Qwen3 config with the target's widths and vocab and the draft's own depth."""
    heads = int(target["num_attention_heads"])
    rope = target.get("rope_parameters") or {}
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target["hidden_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": target.get("num_key_value_heads") or heads,
        "head_dim": target.get("head_dim") or target["hidden_size"] // heads,
        "intermediate_size": target["intermediate_size"],
        "num_hidden_layers": num_layers,
        "vocab_size": target["vocab_size"],
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": target.get("rope_theta", rope.get("rope_theta", 1_000_000.0)),
        "rope_scaling": None,
        "max_position_embeddings": target.get("max_position_embeddings", 40960),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "dtype": "float32",
        "block_size": block_size,
        "num_target_layers": target["num_hidden_layers"],
        "dflash_config": dflash_config,
    }


def random_draft_weights(
    config: dict[str, Any], num_features: int, seed: int
) -> dict[str, torch.Tensor]:
    """Random tensors under the z-lab names. Norm weights are spread around 1 so that a loader
    that skips or swaps a norm changes the drafts; linears use the target's decisive scale."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_out = config["num_attention_heads"] * d
    kv_out = config["num_key_value_heads"] * d

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * DECISIVE_INIT

    def norm(size: int) -> torch.Tensor:
        return torch.rand(size, generator=gen) + 0.5

    weights = {
        "fc.weight": linear(h, num_features * h),
        "hidden_norm.weight": norm(h),
        "norm.weight": norm(h),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        weights |= {
            p + "input_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": linear(q_out, h),
            p + "self_attn.k_proj.weight": linear(kv_out, h),
            p + "self_attn.v_proj.weight": linear(kv_out, h),
            p + "self_attn.o_proj.weight": linear(h, q_out),
            p + "self_attn.q_norm.weight": norm(d),
            p + "self_attn.k_norm.weight": norm(d),
            p + "post_attention_layernorm.weight": norm(h),
            p + "mlp.gate_proj.weight": linear(inter, h),
            p + "mlp.up_proj.weight": linear(inter, h),
            p + "mlp.down_proj.weight": linear(h, inter),
        }
    return weights


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m batchrun.tools.tiny_draft",
        description="Write a random DFlash draft checkpoint for a (tiny) Qwen3 target.",
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--target", type=Path, required=True, help="the target model directory")
    parser.add_argument("--layers", type=int, default=1, help="draft decoder layers")
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument(
        "--layer-ids", default=None, help="comma-separated target layer ids (default: derived)"
    )
    parser.add_argument("--mask-id", type=int, default=None, help="mask token id")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    layer_ids = [int(x) for x in args.layer_ids.split(",")] if args.layer_ids else None
    out = make_tiny_draft(
        args.out_dir,
        args.target,
        num_layers=args.layers,
        block_size=args.block_size,
        target_layer_ids=layer_ids,
        mask_token_id=args.mask_id,
        seed=args.seed,
    )
    print(out)


if __name__ == "__main__":
    main()

"""Write a tiny DFlash draft checkpoint for a tiny target, for tests and demos: the z-lab
format, or the speculators one; optionally with sliding-window layers and a reduced vocabulary.

    python -m batchrun.tools.tiny_draft OUT_DIR --target DIR [--layers N] [--block-size B]
                                        [--layer-ids 0,2] [--mask-id N] [--seed S]
                                        [--sliding-window W --sliding-layers 0,1]
                                        [--draft-vocab N] [--speculators]
                                        [--layers-type qwen3|llama]

The draft has no embedding (it borrows the target's) and no lm_head unless its vocabulary is
reduced, so its shape is read from the target's config.json; see docs/dflash.md section 1 for
the z-lab format and batchrun/models/dflash_formats.py for the speculators one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer, Qwen3Config

from batchrun.models.dflash import default_target_layer_ids
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
    sliding_window: int | None = None,
    sliding_layers: list[int] | None = None,
    draft_vocab: list[int] | None = None,
    speculators: bool = False,
    layers: str = "qwen3",
) -> Path:
    """Save a DFlash draft for the target in target_dir to out_dir and return out_dir.

    target_layer_ids None leaves the key out (loaders derive the default ids; the speculators
    format always lists them). mask_token_id None picks the first embedding row the tokenizer
    does not use, or the last row. sliding_layers (default: all) slide over sliding_window
    positions. draft_vocab: the target ids the draft drafts from (a reduced vocabulary: its own
    lm_head, d2t and t2d). speculators: write the speculators format instead of z-lab's.
    layers: the model_type of the draft's layers, "qwen3" or "llama" (no q/k norm weights).
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
    config["model_type"] = layers
    if sliding_window is not None:
        sliding = set(range(num_layers) if sliding_layers is None else sliding_layers)
        config["layer_types"] = [
            "sliding_attention" if i in sliding else "full_attention" for i in range(num_layers)
        ]
        config |= {"use_sliding_window": True, "sliding_window": sliding_window}
    if draft_vocab is not None:
        config["draft_vocab_size"] = len(draft_vocab)
    if state_dict is None:
        num_features = len(target_layer_ids) if target_layer_ids else num_layers
        state_dict = random_draft_weights(config, num_features, seed)
        if draft_vocab is not None:
            state_dict |= vocabulary_tensors(draft_vocab, config, seed)
    if speculators:
        config = speculators_config(config, target_dir)
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


def vocabulary_tensors(
    draft_vocab: list[int], config: dict[str, Any], seed: int
) -> dict[str, torch.Tensor]:
    """A reduced vocabulary's own lm_head, d2t (offsets: target id = draft id + d2t[draft id],
    EAGLE-3's convention) and t2d (which target ids the draft has)."""
    ids = torch.tensor(sorted(draft_vocab))
    gen = torch.Generator().manual_seed(seed + 1)
    head = torch.randn(len(ids), config["hidden_size"], generator=gen) * DECISIVE_INIT
    t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
    t2d[ids] = True
    return {"lm_head.weight": head, "d2t": ids - torch.arange(len(ids)), "t2d": t2d}


# Keys of the z-lab config that the speculators format keeps out of transformer_layer_config.
DFLASH_KEYS = (
    "architectures",
    "block_size",
    "dflash_config",
    "num_target_layers",
    "draft_vocab_size",
)


def speculators_config(zlab: dict[str, Any], target_dir: Path | str) -> dict[str, Any]:
    """The same draft's config in the speculators format (what speculators' DFlash converter
    writes), its transformer_layer_config as transformers 4's diff dict: keys equal to
    Qwen3Config's defaults are left out."""
    dflash = zlab["dflash_config"]
    layers = {k: v for k, v in zlab.items() if k not in DFLASH_KEYS}
    defaults = Qwen3Config().to_dict()
    missing = object()
    layers = {k: v for k, v in layers.items() if k == "model_type" or defaults.get(k, missing) != v}
    layer_ids = dflash.get("target_layer_ids") or default_target_layer_ids(
        zlab["num_hidden_layers"], zlab["num_target_layers"]
    )
    block = zlab["block_size"]
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(target_dir), "architectures": ["Qwen3ForCausalLM"]},
        },
        "transformer_layer_config": layers,
        "draft_vocab_size": zlab.get("draft_vocab_size", zlab["vocab_size"]),
        "block_size": block,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in layer_ids],  # hidden-state indices
        "mask_token_id": dflash["mask_token_id"],
        "sliding_window_non_causal": False,
        "projector_type": "dflash",
        "sample_from_anchor": False,
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
        if config["model_type"] == "llama":  # no q/k norm (drawn all the same: same weights)
            del weights[p + "self_attn.q_norm.weight"], weights[p + "self_attn.k_norm.weight"]
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
    parser.add_argument("--sliding-window", type=int, default=None, help="W of sliding layers")
    parser.add_argument(
        "--sliding-layers", default=None, help="comma-separated sliding layers (default: all)"
    )
    parser.add_argument(
        "--draft-vocab", type=int, default=None, help="a reduced vocabulary of N random ids"
    )
    parser.add_argument("--speculators", action="store_true", help="the speculators format")
    parser.add_argument(
        "--layers-type",
        default="qwen3",
        choices=("qwen3", "llama"),
        help="the draft layers' model_type (llama: no q/k norm)",
    )
    args = parser.parse_args(argv)
    layer_ids = [int(x) for x in args.layer_ids.split(",")] if args.layer_ids else None
    sliding = [int(x) for x in args.sliding_layers.split(",")] if args.sliding_layers else None
    vocab = None
    if args.draft_vocab is not None:
        size = json.loads((args.target / "config.json").read_text())["vocab_size"]
        gen = torch.Generator().manual_seed(args.seed)
        vocab = torch.randperm(size, generator=gen)[: args.draft_vocab].tolist()
    out = make_tiny_draft(
        args.out_dir,
        args.target,
        num_layers=args.layers,
        block_size=args.block_size,
        target_layer_ids=layer_ids,
        mask_token_id=args.mask_id,
        seed=args.seed,
        sliding_window=args.sliding_window,
        sliding_layers=sliding,
        draft_vocab=vocab,
        speculators=args.speculators,
        layers=args.layers_type,
    )
    print(out)


if __name__ == "__main__":
    main()

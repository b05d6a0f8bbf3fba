"""Write a tiny random-weight Qwen3 checkpoint with real tokenizer files, for tests and demos.

python -m batchrun.tools.tiny OUT_DIR [--layers N] [--hidden N] [--heads N] [--kv-heads N]
                                      [--shards N] [--untied] [--tokenizer DIR] ...
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from batchrun.tools.bpe import ENDOFTEXT, IM_END, build_tokenizer

# Transformers' default 0.02 makes a tied model mostly echo its input token (an embedding's dot
# product with itself dominates) and an untied one near-uniform. At 0.2 the layers outweigh the
# embeddings, so outputs depend on the whole context, and top-1/top-2 logit gaps sit hundreds
# of times above float32 noise, so greedy tokens are not decided by rounding.
DECISIVE_INIT = 0.2


def make_tiny_model(
    out_dir: Path | str,
    *,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 512,
    num_shards: int = 1,
    seed: int = 0,
    tokenizer_dir: Path | str | None = None,
    tokenizer_vocab_size: int = 1024,
    initializer_range: float = DECISIVE_INIT,
    rope_parameters: dict[str, Any] | None = None,
    num_experts: int = 0,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    mlp_only_layers: tuple[int, ...] = (),
) -> Path:
    """Save a random Qwen3 and its tokenizer to out_dir and return out_dir.

    vocab_size is the model's embedding rows (None: the tokenizer's length; larger pads, as
    real Qwen checkpoints do). The tokenizer is copied from tokenizer_dir, or trained with
    tokenizer_vocab_size tokens. num_shards is the exact number of safetensors files.
    rope_parameters: transformers' (e.g. YaRN's); None: plain RoPE. num_experts > 0 makes a
    Qwen3-MoE (its layers sparse but mlp_only_layers).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer: PreTrainedTokenizerBase
    if tokenizer_dir is None:
        tokenizer = build_tokenizer(out, vocab_size=tokenizer_vocab_size)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        tokenizer.save_pretrained(str(out))
    vocab_size = len(tokenizer) if vocab_size is None else vocab_size
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} < the tokenizer's {len(tokenizer)} tokens")
    vocab = tokenizer.get_vocab()
    eos_id, pad_id = vocab[IM_END], vocab[ENDOFTEXT]

    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    if num_experts:
        fields |= {
            "num_experts": num_experts,
            "num_experts_per_tok": num_experts_per_tok,
            "moe_intermediate_size": moe_intermediate_size,
            "mlp_only_layers": list(mlp_only_layers),
            "decoder_sparse_step": 1,
        }
    config = Qwen3MoeConfig(**fields) if num_experts else Qwen3Config(**fields)
    if rope_parameters is not None:
        config.rope_parameters = rope_parameters
    torch.manual_seed(seed)
    model: Qwen3ForCausalLM | Qwen3MoeForCausalLM
    if isinstance(config, Qwen3MoeConfig):
        model = Qwen3MoeForCausalLM(config).eval()
    else:
        model = Qwen3ForCausalLM(config).eval()
    _randomize_norms(model)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(str(out), max_shard_size=_shard_size_for(model, num_shards))
    return out


def _randomize_norms(model: torch.nn.Module) -> None:
    """Give every RMSNorm its own weights: at their init of 1 a loader that reads the wrong norm,
    or skips a norm's weight, would still match the reference."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)


def _shard_size_for(model: torch.nn.Module, num_shards: int) -> int:
    """The smallest max_shard_size (bytes) with which transformers writes num_shards files.

    Transformers fills shards greedily in state-dict order, so the count only falls as the size
    grows: a bisection finds the size, and an impossible count is reported instead of missed.
    """
    state = model.state_dict()

    def count(size: int) -> int:
        return len(
            split_torch_state_dict_into_shards(state, max_shard_size=size).filename_to_tensors
        )

    low, high = 1, sum(t.numel() * t.element_size() for t in state.values())
    while low < high:
        mid = (low + high) // 2
        if count(mid) <= num_shards:
            high = mid
        else:
            low = mid + 1
    if count(low) != num_shards:
        raise ValueError(f"cannot split this model into exactly {num_shards} shards")
    return low


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m batchrun.tools.tiny",
        description="Write a tiny random Qwen3 checkpoint with a locally trained tokenizer.",
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64, help="hidden size")
    parser.add_argument("--heads", type=int, default=4, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=128, help="MLP size")
    parser.add_argument(
        "--vocab", type=int, default=None, help="model vocab (default: tokenizer's)"
    )
    parser.add_argument("--tokenizer-vocab", type=int, default=1024, help="BPE vocab to train")
    parser.add_argument("--tokenizer", type=Path, default=None, help="copy this tokenizer instead")
    parser.add_argument("--max-positions", type=int, default=512)
    parser.add_argument("--untied", action="store_true", help="separate lm_head weights")
    parser.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_tiny_model(
        args.out_dir,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate,
        tie_word_embeddings=not args.untied,
        max_position_embeddings=args.max_positions,
        num_shards=args.shards,
        seed=args.seed,
        tokenizer_dir=args.tokenizer,
        tokenizer_vocab_size=args.tokenizer_vocab,
    )
    print(out)


if __name__ == "__main__":
    main()

"""Tiny random Llama 3 checkpoints written by transformers' save_pretrained, with the test
tokenizer, for the Llama target tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from batchrun.tools.bpe import ENDOFTEXT, IM_END
from batchrun.tools.tiny import DECISIVE_INIT

# Llama 3.1's rope_scaling, its original context cut to the tiny model's: the wavelengths of
# head_dim 16 at theta 500000 fall on both sides of original / factor, so the llama3 rule keeps,
# divides and blends frequencies.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def make_tiny_llama(out: Path, tokenizer_dir: Path, **overrides: Any) -> Path:
    """Save a random LlamaForCausalLM (2 layers, GQA 4/2, head_dim 16, untied unless overrides
    say otherwise) and the tokenizer to out; overrides are LlamaConfig's keys (rope_parameters
    None: plain RoPE at theta 500000)."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.save_pretrained(str(out))
    vocab = tokenizer.get_vocab()
    eos_id, pad_id = vocab[IM_END], vocab[ENDOFTEXT]
    fields: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "initializer_range": DECISIVE_INIT,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "bos_token_id": None,
        "rope_parameters": dict(LLAMA3_ROPE),
        "dtype": "float32",
    } | overrides
    if fields["rope_parameters"] is None:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": 500_000.0}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    with torch.no_grad():  # norms off 1, so a skipped or swapped norm changes the outputs
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(str(out))
    return out

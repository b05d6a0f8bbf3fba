"""z-lab's published DFlash and DFlash2 drafters and the targets they were trained for,
declared once: docs/models.md's table of them (config/model_tables.py) says, from this and the
model and method declarations, which batchrun runs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedPair:
    target: str  # the target's Hugging Face repository
    model_type: str  # its config.json's model_type
    drafter: str  # z-lab's drafter repository
    method: str  # the drafter's speculation method (spec_decode/registry.py's names)


PUBLISHED = (
    PublishedPair("Qwen/Qwen3-4B", "qwen3", "z-lab/Qwen3-4B-DFlash-b16", "dflash"),
    PublishedPair("Qwen/Qwen3-8B", "qwen3", "z-lab/Qwen3-8B-DFlash-b16", "dflash"),
    PublishedPair(
        "Qwen/Qwen3-Coder-30B-A3B-Instruct",
        "qwen3_moe",
        "z-lab/Qwen3-Coder-30B-A3B-DFlash",
        "dflash",
    ),
    PublishedPair("Qwen/Qwen3-Coder-Next", "qwen3_next", "z-lab/Qwen3-Coder-Next-DFlash", "dflash"),
    PublishedPair("Qwen/Qwen3.5-4B", "qwen3_5", "z-lab/Qwen3.5-4B-DFlash", "dflash"),
    PublishedPair("Qwen/Qwen3.5-9B", "qwen3_5", "z-lab/Qwen3.5-9B-DFlash", "dflash"),
    PublishedPair("Qwen/Qwen3.5-27B", "qwen3_5", "z-lab/Qwen3.5-27B-DFlash", "dflash"),
    PublishedPair("Qwen/Qwen3.5-35B-A3B", "qwen3_5_moe", "z-lab/Qwen3.5-35B-A3B-DFlash", "dflash"),
    PublishedPair(
        "Qwen/Qwen3.5-122B-A10B", "qwen3_5_moe", "z-lab/Qwen3.5-122B-A10B-DFlash", "dflash"
    ),
    PublishedPair("Qwen/Qwen3.6-27B", "qwen3_5", "z-lab/Qwen3.6-27B-DFlash", "dflash"),
    PublishedPair("Qwen/Qwen3.6-35B-A3B", "qwen3_5_moe", "z-lab/Qwen3.6-35B-A3B-DFlash", "dflash"),
    # Qwen3.8 is a multimodal wrapper (model_type qwen3_8) around a hybrid text model.
    PublishedPair("Qwen/Qwen3.8-27B", "qwen3_8", "z-lab/Qwen3.8-27B-DFlash2", "dflash2"),
    PublishedPair(
        "meta-llama/Llama-3.1-8B-Instruct",
        "llama",
        "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
        "dflash",
    ),
    PublishedPair("openai/gpt-oss-20b", "gpt_oss", "z-lab/gpt-oss-20b-DFlash", "dflash"),
    PublishedPair("openai/gpt-oss-120b", "gpt_oss", "z-lab/gpt-oss-120b-DFlash", "dflash"),
    PublishedPair(
        "google/gemma-4-26B-A4B-it", "gemma4", "z-lab/gemma-4-26B-A4B-it-DFlash", "dflash"
    ),
    PublishedPair("google/gemma-4-31B-it", "gemma4", "z-lab/gemma-4-31B-it-DFlash", "dflash"),
    PublishedPair("MiniMaxAI/MiniMax-M2.5", "minimax_m2", "z-lab/MiniMax-M2.5-DFlash", "dflash"),
    PublishedPair("moonshotai/Kimi-K2.5", "kimi_k25", "z-lab/Kimi-K2.5-DFlash", "dflash"),
)

"""The random prompts `batchrun bench` times, reproducible from their seeds."""

from __future__ import annotations

import torch


def synthetic_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=gen).tolist()


def workload(
    vocab: int, num_prompts: int, prompt_len: int, shared_prefix: int, seed: int
) -> list[list[int]]:
    """Random prompts, each starting with the same shared_prefix tokens when that is > 0."""
    prompts = synthetic_prompts(vocab, num_prompts, prompt_len, seed)
    if not shared_prefix:
        return prompts
    prefix = synthetic_prompts(vocab, 1, shared_prefix, seed + 1)[0]
    return [prefix + p for p in prompts]


def random_prompts(vocab: int, batch: int, context: int) -> list[list[int]]:
    """A steady-state point's prompts, the same for the engine and for generate()."""
    return synthetic_prompts(vocab, batch, context, seed=batch * 7919 + context)

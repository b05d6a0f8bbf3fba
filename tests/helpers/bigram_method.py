"""A speculation method written for the tests: a bigram drafter whose next-token table is its
draft's config.json (d1 = next[anchor], d2 = next[d1], ...). Registered by the `bigram` fixture
(tests/conftest.py); a table learnt from a run's outputs drafts what the target says often, so
its drafts are accepted."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchrun.attention.meta import row_starts
from batchrun.engine.core.requests import Request
from batchrun.errors import JobError
from batchrun.models.loader import read_config
from batchrun.models.qwen3 import Qwen3ForCausalLM, Qwen3Shape
from batchrun.parallel.group import TensorParallel
from batchrun.spec_decode.acceptance import accepted_lengths
from batchrun.spec_decode.base import Speculator, StepShape, TargetView
from batchrun.spec_decode.method import DraftBackends, DraftLayout
from batchrun.spec_decode.width_policy import candidate_widths

ARCHITECTURE = "BigramDraftModel"
BLOCK = 4


class BigramDraft(nn.Module):
    """Drafts by a next-token table: d1 = next[anchor], d2 = next[d1], ..."""

    def __init__(self, spec: dict[str, Any], device: torch.device) -> None:
        super().__init__()
        self.spec, self.block_size = spec, spec["block_size"]
        self.register_buffer("next_token", torch.tensor(spec["next_token"], device=device))


class BigramSpeculator(Speculator):
    def __init__(self, target: TargetView, draft: BigramDraft, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.state, self.next_token = target.state, draft.next_token
        self.drafting, self.block_size, self.widths = True, draft.block_size, widths

    def next_widths(self, slots: Sequence[int], prefill_pending: bool) -> dict[int, int]:
        return dict.fromkeys(slots, self.widths[-1])

    def propose(self, step: StepShape, slots: torch.Tensor) -> torch.Tensor | None:
        d = step.num_decoding
        if not d or step.max_width == 1:
            return None
        token, drafts = self.state.last_token[slots[:d]].long(), []
        for _ in range(step.max_width - 1):
            token = self.next_token[token]
            drafts.append(token)
        return torch.stack(drafts, dim=1)

    def accept(
        self,
        drafts: torch.Tensor | None,
        tokens: torch.Tensor,
        step: StepShape,
        widths: torch.Tensor,
    ) -> torch.Tensor:
        if drafts is None:
            return tokens.new_zeros(step.num_decoding)
        return accepted_lengths(drafts, tokens, row_starts(widths), widths)


class Bigram:
    name = "bigram"
    architectures = frozenset({ARCHITECTURE})

    def check(self, draft_dir: Path, target: Qwen3Shape) -> dict[str, Any]:
        config = read_config(draft_dir, "draft")
        if len(config["next_token"]) != target.vocab_size:
            raise JobError("draft: next_token must map every token of the target")
        return config | {"target": target}

    def check_weights(
        self, draft_dir: Path, spec: dict[str, Any], target: Qwen3Shape, dtype: torch.dtype
    ) -> int:
        return 8 * len(spec["next_token"])

    def describe(self, spec: dict[str, Any]) -> str:
        return f"bigram, block size {spec['block_size']}"

    def layout(self, draft: dict[str, Any] | BigramDraft) -> DraftLayout:
        """No layers of its own: nothing in the pages, no rings, no features."""
        spec = draft if isinstance(draft, dict) else draft.spec
        block = spec["block_size"]
        return DraftLayout(spec["target"], block, candidate_widths(block))

    def load(
        self, draft_dir: Path, target: Qwen3ForCausalLM, device: torch.device, max_positions: int
    ) -> BigramDraft:
        return BigramDraft(self.check(draft_dir, target.shape), device)

    def owns(self, draft: nn.Module) -> bool:
        return isinstance(draft, BigramDraft)

    def make(
        self,
        target: TargetView,
        draft: nn.Module,
        backends: DraftBackends,
        *,
        widths: tuple[int, ...],
        max_batch_size: int,
        tp: TensorParallel | None,
    ) -> Speculator:
        assert isinstance(draft, BigramDraft)
        return BigramSpeculator(target, draft, widths)


def write_draft(out: Path, next_token: Sequence[int], architecture: str = ARCHITECTURE) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [architecture], "block_size": BLOCK, "next_token": list(next_token)}
    (out / "config.json").write_text(json.dumps(config))
    return out


def learnt_table(runs: list[Request], vocab: int) -> list[int]:
    """Each token's successor in these outputs (a token never seen: itself)."""
    table = list(range(vocab))
    for req in runs:
        ids = req.output.token_ids
        for a, b in zip(ids, ids[1:], strict=False):
            table[a] = b
    return table

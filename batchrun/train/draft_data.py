"""Training data of the drafter: token rows read from batchrun output, and random anchors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq
import torch
from transformers import PreTrainedTokenizerBase

from batchrun.io.input.listing import resolve_input_paths


@dataclass(frozen=True)
class TokenRow:
    ids: list[int]  # prompt + completion
    prompt_len: int


def read_rows(
    data: list[str], tokenizer: PreTrainedTokenizerBase, max_len: int
) -> tuple[list[TokenRow], dict[str, int]]:
    """Rows with a completion to learn from, and counts of what was read and skipped."""
    rows: list[TokenRow] = []
    counts = {"files": 0, "rows": 0, "error_rows": 0, "short_rows": 0}
    for spec in data:
        for path in resolve_input_paths(spec):
            counts["files"] += 1
            names = set(pq.read_schema(path).names)
            prompt = "prompt_token_ids" if "prompt_token_ids" in names else "prompt"
            if prompt not in names or "completion_token_ids" not in names:
                raise ValueError(
                    f"{path}: needs a prompt or prompt_token_ids, and a completion_token_ids column"
                )
            columns = [prompt, "completion_token_ids"] + (["error"] if "error" in names else [])
            for row in pq.read_table(path, columns=columns).to_pylist():
                counts["rows"] += 1
                if row.get("error") is not None or row["completion_token_ids"] is None:
                    counts["error_rows"] += 1
                    continue
                # Tokenized as batchrun tokenizes a text prompt.
                ids = row[prompt] if prompt == "prompt_token_ids" else tokenizer.encode(row[prompt])
                seq = (list(ids) + list(row["completion_token_ids"]))[:max_len]
                if len(seq) < len(ids) + 2:  # an anchor and at least one token to predict
                    counts["short_rows"] += 1
                    continue
                rows.append(TokenRow(seq, len(ids)))
    return rows, counts


def split_rows(
    rows: list[TokenRow], eval_rows: int, seed: int
) -> tuple[list[TokenRow], list[TokenRow]]:
    """(train, held-out): a seeded choice of at most a tenth of the rows is held out."""
    order = np.random.default_rng(seed).permutation(len(rows))
    n_eval = min(eval_rows, max(1, len(rows) // 10)) if len(rows) > 1 else 0
    return [rows[i] for i in order[n_eval:]], [rows[i] for i in order[:n_eval]]


def pad_rows(rows: list[TokenRow], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [N, T] right-padded, lengths [N], prompt lengths [N]."""
    width = max(len(r.ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r.ids)] = torch.tensor(r.ids)
    lens = torch.tensor([len(r.ids) for r in rows])
    return ids, lens, torch.tensor([r.prompt_len for r in rows])


def sample_anchors(
    prompt_lens: torch.Tensor, lens: torch.Tensor, count: int, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to count distinct anchors per row in [prompt_len, len - 2]: (positions, valid) [N, K]."""
    anchors = torch.zeros(len(lens), count, dtype=torch.long)
    valid = torch.zeros(len(lens), count, dtype=torch.bool)
    for i, (start, stop) in enumerate(zip(prompt_lens.tolist(), (lens - 1).tolist(), strict=True)):
        chosen = rng.choice(np.arange(start, stop), size=min(count, stop - start), replace=False)
        anchors[i, : len(chosen)] = torch.from_numpy(np.sort(chosen))
        valid[i, : len(chosen)] = True
    return anchors, valid

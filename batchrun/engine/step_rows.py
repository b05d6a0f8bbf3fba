"""The row layout of one step, for the engine: each scheduled item feeds num_new rows in batch
order and samples its last k of them (every row of a decode/verify; the last row of a prefill
chunk that completes a fresh prompt; none otherwise). From it: the target's input ids and
metadata, the sampling parameters of the sampled rows, each verify's accepted drafts, and the
target features of the rows each item commits."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from batchrun.attention.meta import HostMeta, host_meta
from batchrun.engine.request import SamplingParams
from batchrun.engine.sampler import SamplingBatch
from batchrun.engine.scheduler import Scheduled
from batchrun.speculative.acceptance import accepted_lengths


def rows_sampled(it: Scheduled) -> int:
    if it.decoding:
        return it.num_new
    req = it.req
    return int(not req.output_ids and req.num_cached + it.num_new == len(req.prompt_ids))


def target_rows(
    batch: list[Scheduled],
    samples: list[int],
    drafts: torch.Tensor | None,
    page_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, HostMeta, torch.Tensor | None]:
    """The input ids on the device (a verify's drafts filled in there), the metadata, and the
    flat rows to sample (None when that is every row)."""
    ids: list[int] = []
    draft_rows: list[int] = []
    sampled: list[int] = []
    row = 0
    for it, k in zip(batch, samples, strict=True):
        req, start, n = it.req, it.req.num_cached, it.num_new
        if it.decoding:
            ids.append(req.output_ids[-1])
            ids.extend([0] * (n - 1))
            draft_rows.extend(range(row + 1, row + n))
        else:
            ids.extend(req.token_slice(start, start + n))
        sampled.extend(range(row + n - k, row + n))
        row += n
    starts = np.array([it.req.num_cached for it in batch], dtype=np.int64)
    q_lens = np.array([it.num_new for it in batch], dtype=np.int64)
    host = host_meta(starts, q_lens, [it.req.pages for it in batch], page_size)
    device_ids = torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True)
    if drafts is not None and draft_rows:
        index = torch.tensor(draft_rows, dtype=torch.long).to(device, non_blocking=True)
        device_ids[index] = drafts.reshape(-1)
    if len(sampled) == row:
        return device_ids, host, None
    return device_ids, host, torch.tensor(sampled, dtype=torch.long).to(device)


def sampling_batch(
    batch: list[Scheduled], samples: list[int], vocab_size: int, device: torch.device
) -> SamplingBatch:
    params: list[SamplingParams] = []
    steps: list[int] = []
    for it, k in zip(batch, samples, strict=True):
        params += [it.req.params] * k
        steps += range(len(it.req.output_ids), len(it.req.output_ids) + k)

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return SamplingBatch(
        temperature=tensor([p.temperature for p in params], torch.float32),
        top_p=tensor([p.top_p for p in params], torch.float32),
        # A top_k of the vocabulary or more keeps every token, as 0 does.
        top_k=tensor([p.top_k if p.top_k < vocab_size else 0 for p in params], torch.long),
        seed=tensor([as_int64(p.seed) for p in params], torch.long),
        step=tensor(steps, torch.long),
    )


def as_int64(value: int) -> int:
    """A 64-bit seed (any integer, taken mod 2^64) as the int64 with the same bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def accepted(
    batch: list[Scheduled], samples: list[int], tokens: torch.Tensor, drafts: torch.Tensor | None
) -> torch.Tensor:
    """Accepted drafts per verifying item, on the device (empty without drafts)."""
    if drafts is None:
        return tokens.new_zeros(0)
    width = drafts.shape[1] + 1
    starts, pos = [], 0
    for it, k in zip(batch, samples, strict=True):
        if it.decoding:
            starts.append(pos)
        pos += k
    if len(starts) * width == len(tokens):
        post = tokens.view(-1, width)
    else:
        index = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(width)
        post = tokens[index.to(tokens.device)]
    return accepted_lengths(drafts, post).to(tokens.dtype)


def committed_features(
    batch: list[Scheduled], accepted: list[int], features: torch.Tensor | None
) -> Iterator[torch.Tensor] | None:
    """Per item, the target features of the rows it commits (a prefill chunk: all; a verify:
    the anchor and the accepted drafts), gathered in one copy: the draft's next forward reads
    them, and a graph's outputs are overwritten by the next replay."""
    if features is None:
        return None
    counts, index, row, dec = [], [], 0, 0
    for it in batch:
        keep = it.num_new
        if it.decoding:
            keep = 1 + (accepted[dec] if accepted else 0)
            dec += 1
        index.append(np.arange(row, row + keep))
        counts.append(keep)
        row += it.num_new
    rows = torch.from_numpy(np.concatenate(index)).to(features.device, non_blocking=True)
    return iter(features.index_select(0, rows).split(counts))

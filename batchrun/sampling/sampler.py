"""Batched sampling as a pure function of (logits, parameters, seed, step).

Randomness is Gumbel noise from Philox-4x32-10 keyed by the row's 64-bit seed, with its 64-bit
token index (step) and the token id as the counter (batchrun/sampling/philox.py), not from a
generator's state: a row's sample does not depend on what else is in the batch, on preemption,
or on whether the token comes from a plain decode step or a speculative verify row.

Memory: sampled rows are processed in chunks whose temporaries stay under
max(CHUNK_BYTES, BATCH_BYTES_PER_LOGIT x the batch's logits). Rows without top-k/top-p add
noise to every logit and take the argmax, with no sort; filtered rows keep their candidates with
topk (a full sort only when some row of the chunk has top-p without top-k) and draw noise only
for the candidates.

On CUDA, when triton imports, greedy and unfiltered rows take one Triton launch instead
(batchrun/sampling/triton_sampling.py): the same tokens, noise regenerated in registers rather than
held as int64 words; the torch path stays the reference and the CPU path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchrun.kernels.dispatch import cuda_kernel
from batchrun.sampling.params import SamplingParams
from batchrun.sampling.philox import philox_uniform

# Peak temporaries per logit of a chunk, measured: 68 bytes drawing noise for every logit (eight
# live int64 Philox words and the float32 logits), 78 with a full sort before it.
TEMP_BYTES_PER_LOGIT = 80
CHUNK_BYTES = 64 << 20
BATCH_BYTES_PER_LOGIT = 4


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [N] float32; 0 = greedy
    top_p: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] int64; 0 = off
    seed: torch.Tensor  # [N] int64: the 64-bit seed in two's complement
    step: torch.Tensor  # [N] int64: index of the output token this row samples
    min_p: torch.Tensor | None = None  # [N] float32; 0 (or None: every row) = off

    def filtered(self) -> torch.Tensor:
        """[N] bool: the rows that filter their candidates (top-k, top-p or min-p)."""
        rows = (self.top_k > 0) | (self.top_p < 1)
        return rows if self.min_p is None else rows | (self.min_p > 0)

    def candidates(
        self, scaled: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """filter_candidates of the temperature-scaled logits [R, V] of the batch's `rows`."""
        min_p = self.min_p[rows] if self.min_p is not None else None
        return filter_candidates(scaled, self.top_k[rows], self.top_p[rows], min_p)


def draws_filtered(params: SamplingParams) -> bool:
    """A row of these parameters draws among filtered candidates (SamplingBatch.filtered, at
    a temperature above 0), known on the host."""
    return params.temperature > 0 and bool(params.top_k or params.top_p < 1 or params.min_p > 0)


def rows_per_chunk(num_rows: int, vocab: int) -> int:
    """Rows sampled together: their temporaries fit max(CHUNK_BYTES, a few bytes per logit of
    the whole batch), so few chunks on a large batch and bounded memory on any batch."""
    budget = max(CHUNK_BYTES, BATCH_BYTES_PER_LOGIT * num_rows * vocab)
    return max(1, budget // (TEMP_BYTES_PER_LOGIT * vocab))


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[N, M] float32 standard Gumbel noise of each row's (seed, step) at token_ids."""
    u = philox_uniform(seed, step, token_ids)
    return u.log_().neg_().log_().neg_()


def sample(logits: torch.Tensor, batch: SamplingBatch, any_filtered: bool = True) -> torch.Tensor:
    """logits [N, V] -> token ids [N] (int64). any_filtered=False: the caller knows no row
    has top-k, top-p or min-p, which spares the search for them (a device-to-host sync)."""
    sampled = batch.temperature > 0
    filtered = batch.filtered()
    kernel = _plain_kernel(logits)
    draws: list[tuple[torch.Tensor, Draw]]
    if kernel is not None:
        # One pass for every greedy and unfiltered row, the same tokens as _draw_plain; filtered
        # rows take the argmax there (temperature 0) and are drawn below.
        tokens = kernel(
            logits, batch.temperature.masked_fill(filtered, 0.0), batch.seed, batch.step
        )
        draws = [(sampled & filtered, _draw_filtered)] if any_filtered else []
    else:
        tokens = logits.argmax(dim=-1)
        if not bool(sampled.any()):
            return tokens
        draws = [(sampled & ~filtered, _draw_plain), (sampled & filtered, _draw_filtered)]
    size = rows_per_chunk(logits.shape[0], logits.shape[-1])
    for rows, draw in draws:
        index = rows.nonzero().squeeze(1)
        for chunk in index.split(size) if index.numel() else ():
            tokens[chunk] = draw(logits, batch, chunk)
    return tokens


Draw = Callable[[torch.Tensor, SamplingBatch, torch.Tensor], torch.Tensor]
PlainKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _plain_kernel(logits: torch.Tensor) -> PlainKernel | None:
    """The Triton sampler for CUDA logits when triton imports; None keeps the torch path (the
    reference, and the CPU path)."""
    kernel: PlainKernel | None = cuda_kernel(
        logits, "batchrun.sampling.triton_sampling", "sample_plain"
    )
    return kernel


def _scaled(logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor) -> torch.Tensor:
    return logits[rows].float().div_(batch.temperature[rows, None])


def _draw_plain(logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor) -> torch.Tensor:
    scaled = _scaled(logits, batch, rows)
    ids = torch.arange(scaled.shape[-1], device=scaled.device)
    return scaled.add_(gumbel_noise(batch.seed[rows], batch.step[rows], ids)).argmax(dim=-1)


def _draw_filtered(logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor) -> torch.Tensor:
    """Draws among each row's candidates (filter_candidates)."""
    values, ids = batch.candidates(_scaled(logits, batch, rows), rows)
    choice = values.add_(gumbel_noise(batch.seed[rows], batch.step[rows], ids)).argmax(dim=-1)
    return ids.gather(1, choice[:, None]).squeeze(1)


def filter_candidates(
    scaled: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens a row of temperature-scaled logits [N, V] keeps: those at least min_p times
    as probable as its most probable one, of them its top-k, then the smallest most probable
    set whose renormalised mass reaches top_p (at least one token).
    Returns (values, ids) [N, M], most probable first, M the most any row keeps; the values of
    tokens a row drops are -inf. Takes `scaled` over (it may be freed)."""
    vocab = scaled.shape[-1]
    if min_p is not None:  # p < min_p x p_max, in logits: below max + log(min_p)
        floor = scaled.amax(dim=-1, keepdim=True) + min_p[:, None].log()
        scaled.masked_fill_(scaled < floor, float("-inf"))
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    widest = int(k.max())
    if widest < vocab:
        values, ids = scaled.topk(widest, dim=-1)
    else:
        values, ids = scaled.sort(dim=-1, descending=True)
    del scaled
    rank = torch.arange(widest, device=values.device)[None, :]
    values.masked_fill_(rank >= k[:, None], float("-inf"))
    probs = values.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    del probs
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1) & (rank > 0)
    del mass_before
    values.masked_fill_(drop, float("-inf"))
    kept = int((values > float("-inf")).sum(dim=-1).max())  # the kept tokens lead every row
    return values[:, :kept], ids[:, :kept]

"""Speculative rejection sampling of drafts proposed from a distribution q (Leviathan et al. 2023,
Chen et al. 2023), as tokens the engine's acceptance compares (spec_decode/acceptance.py):

    post_j = x_j                          with probability min(1, p_j(x_j) / q_j(x_j))
           = a sample of norm(max(p_j - q_j, 0))   otherwise (never x_j)
    post at the bonus row = a sample of p

where p_j is the target's distribution at verify row j (the processed logits divided by the
row's temperature and filtered by its top-k/top-p/min-p, as the sampler does) and q_j the
proposal's over its K candidates (zero elsewhere). Accepted drafts then equal post, and the
first mismatch commits post's token, so the output is distributed as the target's alone
whatever q is. With a point-mass q this is sample-and-compare in distribution; greedy rows take
the argmax.

Randomness, as the sampler's, is Philox keyed by the row's seed with its token index (step) in
the counter (sampling/philox.py), so seeded rows reproduce. The draws from p and from the
residual add the sampler's own Gumbel noise (word 0 of counter (step, token id, 0)), so a bonus
row's token is the sampler's (its torch path's, token for token). The acceptance test and the
proposal's walk take word 0 of (step, 0, stream), streams of their own (ACCEPT_STREAM,
PROPOSAL_STREAM), independent of the noise and of each other.

Rows are the sampler's: logits [T, V], one per verify row, request n's rows offsets[n] ..
offsets[n + 1] - 1 (its verified drafts, then its bonus row), so each request may verify its
own number of drafts.
"""

from __future__ import annotations

import torch

from batchrun.sampling.philox import philox4x32_10, split64
from batchrun.sampling.sampler import SamplingBatch, gumbel_noise, rows_per_chunk

ACCEPT_STREAM = 1  # counter word 3 of the acceptance test's uniforms (the sampler's noise: 0)
PROPOSAL_STREAM = 2  # ... of the proposal walk's uniforms


def stream_uniform(seed: torch.Tensor, step: torch.Tensor, stream: int) -> torch.Tensor:
    """float32 uniforms in (0, 1) of broadcastable int64 seed and step (64-bit values): word 0
    of Philox-4x32-10 at counter (step, 0, stream) under the seed's key, rounded as
    philox_uniform rounds."""
    seed, step = torch.broadcast_tensors(seed, step)
    k0, k1 = split64(seed)
    s0, s1 = split64(step)
    zero = torch.zeros_like(s0)
    x0 = philox4x32_10((s0, s1, zero, zero + stream), (k0, k1))[0]
    return (x0 >> 8).float().clamp_(min=0.5).mul_(2.0**-24)


def proposal_uniforms(seed: torch.Tensor, first_step: torch.Tensor, positions: int) -> torch.Tensor:
    """The walk's uniforms [N, positions] for rows of seed [N] whose first draft is output token
    first_step [N]: position j's at step first_step + j, the step its verify row samples."""
    steps = first_step[:, None] + torch.arange(positions, device=first_step.device)[None, :]
    return stream_uniform(seed[:, None], steps, PROPOSAL_STREAM)


def verify_tokens(
    logits: torch.Tensor,
    batch: SamplingBatch,
    offsets: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor,
    candidates: torch.Tensor,
    any_filtered: bool = True,
) -> torch.Tensor:
    """The post token of every verify row: logits [T, V] (the processed logits, before the
    temperature), batch the sampling parameters of the T rows, offsets [N + 1] int64 (request
    n's rows offsets[n] .. offsets[n + 1] - 1), drafts [N, P] int64, q and candidates [N, P, K]
    (the walk's distribution over each position's candidate token ids, distinct within a
    position, as a top-K's are). Returns [T] int64. any_filtered=False: no row has top-k, top-p
    or min-p, and then nothing syncs with the host (filtering reads the widest top-k back, as
    the sampler's does)."""
    total, vocab = logits.shape
    if drafts.shape[1] == 0:  # bonus rows only: one unread column keeps the gathers in range
        drafts = drafts.new_zeros(drafts.shape[0], 1)
        q = q.new_zeros(q.shape[0], 1, max(q.shape[2], 1))
        candidates = candidates.new_zeros(q.shape)
    rows = torch.arange(total, device=logits.device)
    request = torch.searchsorted(offsets, rows, right=True) - 1
    position = rows - offsets[request]
    is_draft = rows < offsets[request + 1] - 1
    # A bonus row reads position 0's draft and discards the result (no branch on the host).
    position = torch.where(is_draft, position, torch.zeros_like(position))
    tokens = torch.empty(total, dtype=torch.int64, device=logits.device)
    for chunk in rows.split(rows_per_chunk(total, vocab)):
        n, j = request[chunk], position[chunk]
        tokens[chunk] = _verify_chunk(
            logits,
            batch,
            chunk,
            drafts[n, j],
            q[n, j],
            candidates[n, j],
            is_draft[chunk],
            any_filtered,
        )
    return tokens


def _verify_chunk(
    logits: torch.Tensor,
    batch: SamplingBatch,
    rows: torch.Tensor,
    draft: torch.Tensor,
    q: torch.Tensor,
    candidates: torch.Tensor,
    is_draft: torch.Tensor,
    any_filtered: bool,
) -> torch.Tensor:
    raw = logits[rows].float()
    greedy = raw.argmax(dim=-1)
    temperature = batch.temperature[rows]
    sampled = temperature > 0
    seed, step = batch.seed[rows], batch.step[rows]
    ids = torch.arange(raw.shape[-1], device=raw.device)
    noise = gumbel_noise(seed, step, ids)  # first: its Philox words are the chunk's peak
    scaled = raw.div_(torch.where(sampled, temperature, torch.ones_like(temperature))[:, None])
    if any_filtered:
        values, kept = batch.candidates(scaled, rows)
        scaled = torch.full_like(noise, float("-inf")).scatter_(1, kept, values)
    # The sampler's own draw (its scaled logits plus its noise, so its token): the bonus row's,
    # and the fallback should rounding leave the residual no mass.
    from_p = scaled.add(noise).argmax(dim=-1)
    log_p = scaled.log_softmax(dim=-1)
    del scaled
    p_draft = log_p.gather(1, draft[:, None]).squeeze(1).exp()
    q_draft = (q * (candidates == draft[:, None])).sum(dim=-1)
    u = stream_uniform(seed, step, ACCEPT_STREAM)
    accept = u * q_draft < p_draft  # u < p / q, without dividing by a zero q
    p_candidates = log_p.gather(1, candidates).exp()
    residual = log_p.scatter_(1, candidates, (p_candidates - q).clamp_(min=0).log_())
    has_residual = residual.amax(dim=-1) > float("-inf")
    from_residual = residual.add_(noise).argmax(dim=-1)
    rejected = torch.where(has_residual, from_residual, from_p)
    drawn = torch.where(is_draft, torch.where(accept, draft, rejected), from_p)
    return torch.where(sampled, drawn, greedy)

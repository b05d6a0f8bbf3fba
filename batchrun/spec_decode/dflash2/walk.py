"""DFlash2's proposal walk over the candidate selector's edges (docs/dflash.md, "DFlash2's walk").

Per draft position j the draft head keeps its top-K tokens (unary logits, sorted descending);
the edge from the previous token p to candidate c scores

    score_j(c) = <predecessor[p] * hidden_proj[j], successor[c]> + unary_j(c)

(the product over the selector rank R first, summed in float32, then the unary added), and the
walk goes from the verified anchor (p_0 = anchor) position by position, p_{j+1} = the token
chosen at j. hidden_proj[j] is the selector's projection of draft position j's own hidden row
(block row j + 1: the anchor's row is no draft position); the caller builds it.

Temperature 0 takes the argmax, ties to the lower candidate index (the higher unary: the order
the draft head ranked them), and q is a point mass on it. Temperature T > 0 draws from
softmax(score / T) over the K candidates by inverse CDF with the row's uniform for the
position, and q is that softmax: the verifier (sampling/draft_verify.py) needs it to keep the
target's distribution.

Batched on the device with static shapes and no host sync, so it captures in a CUDA graph: on
CUDA, when triton imports, one Triton program per row (triton_walk.py, which also draws the
uniforms); the torch version below is the reference and the CPU path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from batchrun.kernels.dispatch import cuda_kernel
from batchrun.sampling.draft_verify import proposal_uniforms


class WalkInputs(NamedTuple):
    """What the walk scores, N rows of P draft positions of K candidates each."""

    unary: torch.Tensor  # f32[N, P, K]: the draft head's logits, sorted descending
    candidates: torch.Tensor  # i64[N, P, K]: their tokens
    hidden_proj: torch.Tensor  # f32[N, P, R]: each position's projected hidden row
    anchors: torch.Tensor  # i64[N]: the verified token each row's walk starts from
    predecessor: torch.Tensor  # [V, R], any float dtype: the selector's codebooks
    successor: torch.Tensor  # [V, R]
    temperature: torch.Tensor  # f32[N]: 0 is greedy


class Walk(NamedTuple):
    tokens: torch.Tensor  # [N, P] int64: the proposed drafts
    q: torch.Tensor  # [N, P, K] float32: the proposal's distribution over its candidates


WalkKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def walk(inputs: WalkInputs, seed: torch.Tensor, first_step: torch.Tensor) -> Walk:
    """The walk of each row; the rows' seed and first_step i64[N]: position j's uniform is the
    proposal stream's at step first_step + j (sampling/draft_verify.py). The Triton kernel on
    CUDA (it draws the uniforms itself), else walk_torch."""
    kernel = _kernel(inputs.unary)
    if kernel is None:
        return walk_torch(inputs, proposal_uniforms(seed, first_step, inputs.unary.shape[1]))
    return Walk(*kernel(inputs, seed=seed.contiguous(), first_step=first_step.contiguous()))


def _kernel(unary: torch.Tensor) -> WalkKernel | None:
    kernel: WalkKernel | None = cuda_kernel(
        unary, "batchrun.spec_decode.dflash2.triton_walk", "walk_triton"
    )
    return kernel


def walk_torch(inputs: WalkInputs, uniforms: torch.Tensor) -> Walk:
    """The reference walk, position j of row i drawing with uniforms[i, j]: batched over the N
    rows, a loop over the P positions."""
    unary, candidates, hidden_proj, anchors, predecessor, successor, temperature = inputs
    n, p, k = unary.shape
    sampled = temperature > 0
    # Greedy rows divide by 1: their softmax is computed and discarded, no branch on the host.
    inv_t = torch.where(sampled, temperature, torch.ones_like(temperature)).reciprocal()[:, None]
    slot = torch.arange(k, device=unary.device)
    tokens = torch.empty(n, p, dtype=torch.int64, device=unary.device)
    q = torch.empty(n, p, k, dtype=torch.float32, device=unary.device)
    previous = anchors
    for j in range(p):
        context = predecessor[previous].float() * hidden_proj[:, j].float()  # [N, R]
        succ = successor[candidates[:, j]].float()  # [N, K, R]
        score = (succ * context[:, None, :]).sum(dim=-1) + unary[:, j].float()  # [N, K]
        greedy = score.argmax(dim=-1)  # first maximum: the lower candidate index
        soft = (score * inv_t).softmax(dim=-1)
        drawn = inverse_cdf(soft, uniforms[:, j])
        choice = torch.where(sampled, drawn, greedy)
        point = (slot[None, :] == greedy[:, None]).float()
        q[:, j] = torch.where(sampled[:, None], soft, point)
        previous = candidates[:, j].gather(1, choice[:, None]).squeeze(1)
        tokens[:, j] = previous
    return Walk(tokens, q)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N, K] probabilities, [N] uniforms in (0, 1) -> [N] the first index whose cumulative
    mass reaches u times the total. Scaling u by the row's own total (not 1) keeps float
    rounding from running past the last candidate, and never picks a zero-probability one."""
    cdf = probs.cumsum(dim=-1)
    below = cdf < (u * cdf[:, -1])[:, None]
    return below.sum(dim=-1).clamp_(max=probs.shape[-1] - 1)

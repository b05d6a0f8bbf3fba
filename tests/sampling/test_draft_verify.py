"""Rejection sampling of proposed drafts (sampling/draft_verify.py): the output is distributed as
the target's alone whatever the proposal's q (chi-square tests at temperature 1, one position and
the joint of two), a point-mass q gives sample-and-compare's distribution, greedy rows take the
argmax, and a request's tokens depend on its own rows only, whatever the batch's widths.

The chi-square thresholds are the distribution's quantile at a false-alarm rate of 1e-9, from
its exact survival function (the regularized upper incomplete gamma), and every draw is seeded:
a correct verifier fails none of them on any CPU."""

from __future__ import annotations

import math

import pytest
import torch

import batchrun.sampling.draft_verify as draft_verify
from batchrun.sampling.draft_verify import proposal_uniforms, stream_uniform, verify_tokens
from batchrun.sampling.sampler import SamplingBatch, sample

FALSE_ALARM = 1e-9
TRIALS = 20_000


def upper_gamma(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a): the series below a + 1, Lentz's continued fraction above
    (Numerical Recipes' gser and gcf)."""
    if x <= 0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-16:
            n += 1
            term *= x / n
            total += term
        return 1.0 - total * math.exp(log_front)
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    i = 1
    while True:
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            return math.exp(log_front) * h
        i += 1


def chi2_quantile(df: int, alpha: float = FALSE_ALARM) -> float:
    """The c with P(chi2_df > c) = alpha, by bisection."""
    lo, hi = 0.0, df + 100.0 * math.sqrt(df) + 200.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if upper_gamma(df / 2, mid / 2) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def test_the_quantiles_are_the_chi_square_distributions() -> None:
    # P(chi2_2 > c) = exp(-c / 2) exactly; chi2_1's 0.95 quantile is 1.96^2.
    assert chi2_quantile(2, 1e-9) == pytest.approx(-2 * math.log(1e-9), rel=1e-9)
    assert chi2_quantile(1, 0.05) == pytest.approx(1.959964**2, rel=1e-5)


def assert_distributed_as(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Counts over cells against the probabilities: none where the probability is 0, and a
    Pearson statistic under the quantile elsewhere."""
    support = probs > 0
    assert counts[~support].sum() == 0, (counts, probs)
    expected = probs[support].double() * counts.sum()
    assert expected.min() >= 20, "cells too small for the chi-square approximation"
    stat = float(((counts[support].double() - expected) ** 2 / expected).sum())
    assert stat < chi2_quantile(int(support.sum()) - 1), (stat, counts, expected)


def batch_of(n: int, temperature: float, seed0: int, step: int, top_k: int = 0) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((n,), temperature),
        top_p=torch.ones(n),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        seed=torch.arange(seed0, seed0 + n, dtype=torch.int64),
        step=torch.full((n,), step, dtype=torch.int64),
    )


def interleave(*per_position: torch.Tensor) -> torch.Tensor:
    """Rows [M, ...] per position -> the verify layout [M * positions, ...], request-major."""
    return torch.stack(per_position, dim=1).flatten(0, 1)


def layout_batch(m: int, width: int, seed0: int, first_step: int, top_k: int = 0) -> SamplingBatch:
    """The sampling rows of m requests verifying width - 1 drafts each: a request's seed, its
    rows' successive steps."""
    rows = [batch_of(m, 1.0, seed0, first_step + i, top_k) for i in range(width)]
    return SamplingBatch(
        temperature=interleave(*(b.temperature for b in rows)),
        top_p=interleave(*(b.top_p for b in rows)),
        top_k=interleave(*(b.top_k for b in rows)),
        seed=interleave(*(b.seed for b in rows)),
        step=interleave(*(b.step for b in rows)),
    )


def draw(q: torch.Tensor, candidates: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row of candidates [M, K] from q [M, K] (the proposal's own draw)."""
    index = torch.multinomial(q, 1, generator=gen).squeeze(1)
    return candidates.gather(1, index[:, None]).squeeze(1)


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, float("-inf"), float("-inf")])
Q_CASES = {
    "point mass on a likely token": ([0, 1, 2], [1.0, 0.0, 0.0]),
    "point mass on an unlikely token": ([5, 1, 2], [1.0, 0.0, 0.0]),
    "spread": ([4, 0, 3], [0.5, 0.3, 0.2]),
    "disjoint from p's support": ([6, 7, 5], [0.6, 0.4, 0.0]),
}


@pytest.mark.parametrize("case", list(Q_CASES))
@pytest.mark.parametrize("top_k", [0, 4])
def test_the_first_position_is_distributed_as_the_target(case: str, top_k: int) -> None:
    ids, weights = Q_CASES[case]
    m = TRIALS
    candidates = torch.tensor(ids).expand(m, 1, 3)
    q = torch.tensor(weights).expand(m, 1, 3)
    drafts = draw(q[:, 0], candidates[:, 0], torch.Generator().manual_seed(len(case)))[:, None]
    logits = LOGITS.expand(2 * m, -1)
    batch = layout_batch(m, 2, seed0=1000 * top_k, first_step=7, top_k=top_k)
    offsets = torch.arange(0, 2 * m + 1, 2)
    post = verify_tokens(logits, batch, offsets, drafts, q, candidates, any_filtered=top_k > 0)
    first = post[0::2]
    kept = LOGITS if not top_k else LOGITS.masked_fill(torch.arange(8) >= top_k, float("-inf"))
    counts = torch.bincount(first, minlength=8)
    assert_distributed_as(counts, kept.softmax(dim=0))
    assert_distributed_as(torch.bincount(post[1::2], minlength=8), kept.softmax(dim=0))


def test_two_positions_are_jointly_distributed_as_the_target() -> None:
    """x0 ~ q0, x1 ~ q1(. | x0); the target's row 1 is conditioned on x0. Output token 1 is
    post1 when draft 0 is accepted, else the next round's draw from p1(. | post0) (the
    sampler's, at the next step): (out0, out1) must be distributed as p0(a) p1(b | a)."""
    v, m = 5, 40_000
    gen = torch.Generator().manual_seed(11)
    p0_logits = torch.tensor([1.0, 0.6, 0.2, -0.2, -0.5])
    p1_logits = torch.randn(v, v, generator=gen)
    p1_logits[:, 4] = float("-inf")  # token 4 never follows
    candidates0 = torch.tensor([3, 0, 1])  # q0 favours an unlikely token
    q0 = torch.tensor([0.6, 0.3, 0.1])
    candidates1 = torch.stack([torch.randperm(v, generator=gen)[:3] for _ in range(v)])
    q1 = torch.tensor([0.7, 0.2, 0.1])
    x0 = draw(q0.expand(m, 3), candidates0.expand(m, 3), gen)
    x1 = draw(q1.expand(m, 3), candidates1[x0], gen)
    drafts = torch.stack([x0, x1], dim=1)
    q = torch.stack([q0.expand(m, 3), q1.expand(m, 3)], dim=1)
    candidates = torch.stack([candidates0.expand(m, 3), candidates1[x0]], dim=1)
    bonus_logits = torch.zeros(m, v)
    logits = interleave(p0_logits.expand(m, v), p1_logits[x0], bonus_logits)
    batch = layout_batch(m, 3, seed0=5, first_step=20)
    post = verify_tokens(logits, batch, torch.arange(0, 3 * m + 1, 3), drafts, q, candidates)
    post = post.view(m, 3)
    out0 = post[:, 0]
    next_round = sample(p1_logits[out0], batch_of(m, 1.0, seed0=5, step=21))
    out1 = torch.where(out0 == x0, post[:, 1], next_round)
    counts = torch.bincount(out0 * v + out1, minlength=v * v)
    joint = p0_logits.softmax(dim=0)[:, None] * p1_logits.softmax(dim=1)
    assert_distributed_as(counts, joint.flatten())


def test_a_point_mass_q_gives_sample_and_compares_distribution() -> None:
    """A point mass on the draft: the post token is distributed as the sampler's token at the
    same rows (two-sample chi-square), and the bonus rows' tokens are the sampler's own."""
    m = TRIALS
    logits = LOGITS.expand(2 * m, -1)
    batch = layout_batch(m, 2, seed0=77, first_step=3)
    drafts = torch.full((m, 1), 2)
    candidates = torch.tensor([2, 0, 1]).expand(m, 1, 3)
    q = torch.tensor([1.0, 0.0, 0.0]).expand(m, 1, 3)
    post = verify_tokens(logits, batch, torch.arange(0, 2 * m + 1, 2), drafts, q, candidates)
    sampled = sample(logits, batch)
    assert torch.equal(post[1::2], sampled[1::2])
    a = torch.bincount(post[0::2], minlength=8).double()
    b = torch.bincount(sampled[0::2], minlength=8).double()
    seen = (a + b) > 0
    expected = (a + b)[seen] / 2  # equal totals
    stat = float((((a[seen] - expected) ** 2 + (b[seen] - expected) ** 2) / expected).sum())
    assert stat < chi2_quantile(int(seen.sum()) - 1)
    # and the draft's own token is accepted with its target probability
    accepted = (post[0::2] == 2).double().mean()
    assert abs(float(accepted) - float(LOGITS.softmax(dim=0)[2])) < 6 * (0.25 / m) ** 0.5


def test_greedy_rows_take_the_argmax_whatever_the_drafts() -> None:
    gen = torch.Generator().manual_seed(3)
    m, width, v = 6, 4, 30
    logits = torch.randn(m * width, v, generator=gen)
    batch = layout_batch(m, width, seed0=0, first_step=0)
    batch.temperature[: 2 * width] = 0  # two greedy requests beside sampled ones
    drafts = torch.randint(v, (m, width - 1), generator=gen)
    candidates = torch.randint(v, (m, width - 1, 4), generator=gen)
    q = torch.rand(m, width - 1, 4, generator=gen).softmax(dim=-1)
    post = verify_tokens(
        logits, batch, torch.arange(0, m * width + 1, width), drafts, q, candidates
    )
    greedy = batch.temperature == 0
    assert torch.equal(post[greedy], logits[greedy].argmax(dim=-1))


def test_each_request_verifies_its_own_width_independently_of_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Requests verifying 3, 0 and 2 drafts (offsets by cumulative lengths), in chunks of 2
    rows: each request's tokens are those it gets verified alone, and repeat on a rerun."""
    gen = torch.Generator().manual_seed(8)
    v, k, widths = 12, 4, [4, 1, 3]
    offsets = torch.tensor([0, 4, 5, 8])
    total = 8
    logits = torch.randn(total, v, generator=gen)
    batch = SamplingBatch(
        temperature=torch.tensor([1.0] * 5 + [0.7] * 3),
        top_p=torch.tensor([1.0] * 5 + [0.9] * 3),
        top_k=torch.tensor([0] * 4 + [5] + [0] * 3),
        seed=torch.tensor([9] * 4 + [10] + [11] * 3),
        step=torch.tensor([0, 1, 2, 3, 40, 7, 8, 9]),
    )
    candidates = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(9)]).view(3, 3, k)
    q = torch.rand(3, 3, k, generator=gen).softmax(dim=-1)
    drafts = candidates[:, :, 1]
    monkeypatch.setattr(draft_verify, "rows_per_chunk", lambda rows, vocab: 2)
    together = verify_tokens(logits, batch, offsets, drafts, q, candidates)
    assert torch.equal(together, verify_tokens(logits, batch, offsets, drafts, q, candidates))
    for n, width in enumerate(widths):
        rows = torch.arange(int(offsets[n]), int(offsets[n + 1]))
        alone_batch = SamplingBatch(
            temperature=batch.temperature[rows],
            top_p=batch.top_p[rows],
            top_k=batch.top_k[rows],
            seed=batch.seed[rows],
            step=batch.step[rows],
        )
        alone = verify_tokens(
            logits[rows],
            alone_batch,
            torch.tensor([0, width]),
            drafts[n : n + 1, : width - 1],
            q[n : n + 1, : width - 1],
            candidates[n : n + 1, : width - 1],
        )
        assert torch.equal(together[rows], alone), n


def test_the_streams_are_distinct_and_the_proposals_follow_the_steps() -> None:
    seed = torch.tensor([1, 2**63 + 5 - 2**64, 3])
    step = torch.tensor([0, 10, 2**40])
    accept = stream_uniform(seed, step, draft_verify.ACCEPT_STREAM)
    walk = stream_uniform(seed, step, draft_verify.PROPOSAL_STREAM)
    assert not torch.equal(accept, walk)
    assert ((accept > 0) & (accept < 1)).all()
    proposals = proposal_uniforms(seed, step, 3)
    assert torch.equal(proposals[:, 0], walk)
    assert torch.equal(
        proposals[:, 2], stream_uniform(seed, step + 2, draft_verify.PROPOSAL_STREAM)
    )

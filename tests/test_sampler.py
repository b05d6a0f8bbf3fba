"""The sampler draws from the distribution a plain reference defines, as a pure function of
(logits, temperature, top_p, top_k, seed, step).

Each distribution check draws N tokens for one row of logits (distinct steps, or distinct seeds)
and runs a chi-square test against the reference. The same draws are also tested against
subtly wrong references (top-k or top-p off by one token, temperature applied after top-p, top-p on
the mass before top-k, a 10% temperature error), which must be rejected: that shows the bound
is tight enough to catch such bugs, not only loose enough to pass a correct sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from batchrun.engine.sampler import SamplingBatch, sample

N = 40_000
REJECT_P = 1e-6  # a correct sampler fails one check in a million seeds
VOCAB = 24
LOGITS = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 1.5


@dataclass(frozen=True)
class Params:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def reference(logits: torch.Tensor, p: Params, *, mutant: str = "") -> torch.Tensor:
    """softmax(logits / T), keep the top-k, keep the smallest set of most probable tokens whose
    mass reaches top_p, renormalise. A mutant name gives one of the wrong variants."""
    temperature = p.temperature * (1.1 if mutant == "temperature+10%" else 1.0)
    late_temperature = mutant == "temperature-after-top-p"
    probs = (logits / (1.0 if late_temperature else temperature)).softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if p.top_k:
        keep[order[p.top_k + (mutant == "top-k-one-more") :]] = False
    if p.top_p < 1:
        kept = torch.where(keep, probs, 0.0)
        if mutant != "top-p-on-mass-before-top-k":
            kept = kept / kept.sum()
        sorted_probs = kept[order]
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        size = int((mass_before < p.top_p).sum())
        size += {"top-p-one-more": 1, "top-p-one-fewer": -1}.get(mutant, 0)
        keep[order[max(size, 1) :]] = False
    if late_temperature:
        probs = (logits / temperature).softmax(-1)
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def draw(p: Params, *, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    n = len(seeds)
    batch = SamplingBatch(
        temperature=torch.full((n,), p.temperature, dtype=torch.float32),
        top_p=torch.full((n,), p.top_p, dtype=torch.float32),
        top_k=torch.full((n,), p.top_k, dtype=torch.int64),
        seed=seeds,
        step=steps,
    )
    return sample(LOGITS.float().expand(n, VOCAB).contiguous(), batch)


def chi_square_p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of the draws under probs; 0 when a token of probability 0 was drawn. Tokens
    expected fewer than 5 times are pooled so that the chi-square approximation holds."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * len(tokens)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor(len(exp) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


CASES = {
    "temperature-1": Params(),
    "temperature-0.6": Params(temperature=0.6),
    "temperature-1.7": Params(temperature=1.7),
    "top-k-5": Params(top_k=5),
    "top-p-0.81": Params(top_p=0.81),
    "temperature-0.5-top-p-0.92": Params(temperature=0.5, top_p=0.92),
    "temperature-1.5-top-k-8": Params(temperature=1.5, top_k=8),
    "top-k-6-top-p-0.7": Params(top_k=6, top_p=0.7),
    "temperature-0.8-top-k-10-top-p-0.85": Params(temperature=0.8, top_k=10, top_p=0.85),
}
MUTANTS = [
    "top-k-one-more",
    "top-p-one-more",
    "top-p-one-fewer",
    "temperature-after-top-p",
    "top-p-on-mass-before-top-k",
    "temperature+10%",
]


def distinct(wrong: torch.Tensor, probs: torch.Tensor) -> bool:
    """Whether a wrong variant is far enough from the reference that it must be rejected:
    0.02 in total variation, or 0.005 when it moves the support (hundreds of draws then land
    where the other has probability 0)."""
    tv = float((wrong - probs).abs().sum()) / 2
    return tv >= 0.02 or (tv >= 0.005 and bool(((wrong > 0) != (probs > 0)).any()))


@pytest.mark.parametrize("params", list(CASES.values()), ids=list(CASES))
@pytest.mark.parametrize("vary", ["step", "seed"])
def test_distribution_matches_reference(params: Params, vary: str) -> None:
    probs = reference(LOGITS, params)
    if params.top_p < 1:  # the nucleus boundary must not sit on a rounding edge
        before = reference(LOGITS, Params(params.temperature, top_k=params.top_k))
        mass = before.sort(descending=True).values.cumsum(-1)
        assert (mass - params.top_p).abs().min() > 0.005
    count = torch.arange(N, dtype=torch.int64)
    fixed = torch.full((N,), 2**40 + 17, dtype=torch.int64)
    seeds, steps = (fixed, count) if vary == "step" else (count * 7919 + 1, fixed % 1000)
    tokens = draw(params, seeds=seeds, steps=steps)
    assert tokens.dtype == torch.int64 and tokens.shape == (N,)
    assert chi_square_p_value(tokens, probs) > REJECT_P
    for mutant in MUTANTS:
        wrong = reference(LOGITS, params, mutant=mutant)
        if distinct(wrong, probs):
            assert chi_square_p_value(tokens, wrong) < REJECT_P, mutant


def test_every_mutant_is_exercised() -> None:
    """Each wrong variant is detectably far from the reference in at least one case."""
    for mutant in MUTANTS:
        assert any(
            distinct(reference(LOGITS, p, mutant=mutant), reference(LOGITS, p))
            for p in CASES.values()
        ), mutant


def random_batch(n: int, seed: int) -> tuple[torch.Tensor, SamplingBatch]:
    g = torch.Generator().manual_seed(seed)
    temperature = torch.rand(n, generator=g) * 1.5
    temperature[::4] = 0  # greedy rows mixed in
    return torch.randn(n, 50, generator=g) * 2, SamplingBatch(
        temperature=temperature.float(),
        top_p=torch.where(
            torch.rand(n, generator=g) < 0.5, 1.0, torch.rand(n, generator=g)
        ).float(),
        top_k=torch.randint(0, 12, (n,), generator=g),
        seed=torch.randint(0, 2**62, (n,), generator=g),
        step=torch.randint(0, 5000, (n,), generator=g),
    )


def pick(batch: SamplingBatch, rows: torch.Tensor) -> SamplingBatch:
    return SamplingBatch(
        temperature=batch.temperature[rows],
        top_p=batch.top_p[rows],
        top_k=batch.top_k[rows],
        seed=batch.seed[rows],
        step=batch.step[rows],
    )


def test_a_rows_token_does_not_depend_on_the_rest_of_the_batch() -> None:
    logits, batch = random_batch(64, seed=0)
    together = sample(logits, batch)
    alone = torch.cat(
        [sample(logits[i : i + 1], pick(batch, torch.tensor([i]))) for i in range(64)]
    )
    assert torch.equal(together, alone)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sample(logits[perm], pick(batch, perm)), together[perm])
    # Among other rows: the first 64 rows of a larger batch keep their tokens.
    more_logits, more = random_batch(32, seed=1)
    fields = SamplingBatch.__dataclass_fields__
    mixed = SamplingBatch(*(torch.cat([getattr(batch, f), getattr(more, f)]) for f in fields))
    assert torch.equal(sample(torch.cat([logits, more_logits]), mixed)[:64], together)
    assert torch.equal(sample(logits, batch), together)  # and it is repeatable


def test_seed_and_step_both_change_the_draw() -> None:
    n = 200
    params = Params(temperature=1.0)
    base = draw(params, seeds=torch.zeros(n, dtype=torch.int64), steps=torch.arange(n))
    other_seed = draw(params, seeds=torch.ones(n, dtype=torch.int64), steps=torch.arange(n))
    other_step = draw(params, seeds=torch.zeros(n, dtype=torch.int64), steps=torch.arange(n) + n)
    assert (base != other_seed).float().mean() > 0.5
    assert (base != other_step).float().mean() > 0.5


def test_greedy_rows_take_the_argmax() -> None:
    logits, batch = random_batch(64, seed=2)
    batch.temperature[:] = 0
    assert torch.equal(sample(logits, batch), logits.argmax(-1))


@pytest.mark.parametrize("params", [Params(top_k=1), Params(temperature=1.0, top_p=1e-4)])
def test_a_nucleus_of_one_token_is_the_argmax(params: Params) -> None:
    n = 500
    seeds = torch.arange(n, dtype=torch.int64)
    tokens = draw(params, seeds=seeds, steps=seeds)
    assert (tokens == LOGITS.argmax()).all()

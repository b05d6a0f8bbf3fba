"""The sampler draws from the distribution a plain reference defines, as a pure function of
(logits, temperature, top_p, top_k, seed, step).

Each distribution check draws N tokens for one row of logits (distinct steps, or distinct seeds)
and runs a chi-square test against the reference. The same draws are also tested against
subtly wrong references (top-k or top-p off by one token, temperature applied after top-p, top-p on
the mass before top-k, a 10% temperature error), which must be rejected: that shows the bound
is tight enough to catch such bugs, not only loose enough to pass a correct sampler.

The noise generator is checked against Philox-4x32-10's known answers and for using all 64 bits
of seed and token index; the sampler's temporaries are measured, op by op, to stay within its
memory budget.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from batchrun.engine.config import EngineConfig
from batchrun.engine.core.requests import Request
from batchrun.engine.engine import Engine
from batchrun.sampling import sampler
from batchrun.sampling.params import SamplingParams
from batchrun.sampling.philox import MASK32, philox4x32_10, philox_uniform
from batchrun.sampling.sampler import SamplingBatch, sample

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
        min_p=torch.where(torch.rand(n, generator=g) < 0.3, torch.rand(n, generator=g) * 0.3, 0.0),
    )


def pick(batch: SamplingBatch, rows: torch.Tensor) -> SamplingBatch:
    return SamplingBatch(
        temperature=batch.temperature[rows],
        top_p=batch.top_p[rows],
        top_k=batch.top_k[rows],
        seed=batch.seed[rows],
        step=batch.step[rows],
        min_p=batch.min_p[rows] if batch.min_p is not None else None,
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


# Random123's known-answer vectors for Philox-4x32-10: (counter, key, output), 32-bit words.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK32,) * 4, (MASK32,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter,key,want", PHILOX_KAT)
def test_philox_matches_the_known_answers(
    counter: tuple[int, ...], key: tuple[int, ...], want: tuple[int, ...]
) -> None:
    def words(values: tuple[int, ...]) -> list[torch.Tensor]:
        return [torch.tensor([v], dtype=torch.int64) for v in values]

    c0, c1, c2, c3 = words(counter)
    k0, k1 = words(key)
    got = philox4x32_10((c0, c1, c2, c3), (k0, k1))
    assert tuple(int(w) for w in got) == want


def int64(value: int) -> int:
    """A 64-bit unsigned value as the int64 the sampler holds (two's complement)."""
    return value - 2**64 if value >= 2**63 else value


def test_the_noise_uses_every_bit_of_the_seed_and_of_the_token_index() -> None:
    ids = torch.arange(4096)
    base_seed, base_step = 0x0123_4567_89AB_CDEF, 77
    variants = [
        (base_seed ^ 1 << 40, base_step),
        (base_seed ^ 1 << 63, base_step),
        (base_seed, base_step + 2**32),
        (base_seed, base_step + 2**63),
    ]
    seeds = torch.tensor([int64(base_seed)] + [int64(s) for s, _ in variants])
    steps = torch.tensor([int64(base_step)] + [int64(t) for _, t in variants])
    u = philox_uniform(seeds, steps, ids)
    assert u.dtype == torch.float32 and bool(((u > 0) & (u < 1)).all())
    assert len(u.unique()) > 0.99 * u.numel()
    for row in range(1, len(variants) + 1):
        assert float((u[row] == u[0]).float().mean()) < 0.01, variants[row - 1]
    # Sampled tokens too: token indices 2^32 apart do not repeat each other's draws.
    n = 400
    steps = torch.arange(n, dtype=torch.int64)
    near = draw(Params(), seeds=torch.full((n,), 5), steps=steps)
    far = draw(Params(), seeds=torch.full((n,), 5), steps=steps + 2**32)
    assert (near != far).float().mean() > 0.5


def test_unfiltered_draws_match_filters_that_keep_everything() -> None:
    """top_k >= vocab (even 2^62) keeps every token: the same draws as no filter."""
    n = 300
    seeds, steps = torch.arange(n, dtype=torch.int64), torch.arange(n, dtype=torch.int64) * 3
    plain = draw(Params(), seeds=seeds, steps=steps)
    for top_k in (VOCAB, 2**62):
        assert torch.equal(draw(Params(top_k=top_k), seeds=seeds, steps=steps), plain)


def test_a_top_p_of_zero_in_float32_keeps_the_most_probable_token() -> None:
    n = 200
    seeds = torch.arange(n, dtype=torch.int64)
    tokens = draw(Params(top_p=5e-324), seeds=seeds, steps=seeds)
    assert (tokens == LOGITS.argmax()).all()


class PeakBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages that operations inside the mode allocate, counted while
    a tensor on them is alive."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, list[int]] = {}  # storage pointer -> [bytes, live tensors]
        self.now = self.peak = 0

    def _drop(self, key: int) -> None:
        entry = self.refs[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or id(t) in inputs:
                continue  # in-place results are counted where they were made
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self.refs:
                self.refs[key] = [storage.nbytes(), 0]
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
            self.refs[key][1] += 1
            weakref.finalize(t, self._drop, key)
        return out


@pytest.mark.parametrize(
    "params",
    [Params(0.7), Params(0.7, top_k=40), Params(0.7, top_p=0.9), Params(0.7, 0.999, top_k=0)],
    ids=["plain", "top-k", "top-p", "top-p-wide"],
)
def test_sampling_temporaries_stay_a_few_bytes_per_logit(
    params: Params, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the per-chunk floor lowered to a small batch's scale, the sampler's temporaries peak
    at the batch budget: BATCH_BYTES_PER_LOGIT bytes per logit of the batch, where building the
    noise of the whole batch at once takes over 60. Greedy rows among them still take the argmax."""
    monkeypatch.setattr(sampler, "CHUNK_BYTES", 1 << 20)
    rows, vocab = 96, 8192
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(rows, vocab, generator=g) * 3
    batch = SamplingBatch(
        temperature=torch.full((rows,), params.temperature).index_fill_(
            0, torch.arange(0, rows, 8), 0
        ),
        top_p=torch.full((rows,), params.top_p),
        top_k=torch.full((rows,), params.top_k, dtype=torch.int64),
        seed=torch.arange(rows, dtype=torch.int64),
        step=torch.zeros(rows, dtype=torch.int64),
    )
    budget = sampler.BATCH_BYTES_PER_LOGIT * rows * vocab
    assert budget > sampler.CHUNK_BYTES
    with PeakBytes() as memory:
        tokens = sample(logits, batch)
    assert memory.peak <= budget + 64 * rows  # and a few per-row vectors
    greedy = batch.temperature == 0
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
    assert (tokens[~greedy] != logits[~greedy].argmax(-1)).any()


def run_sampled(model: Path, params: list[SamplingParams]) -> list[list[int]]:
    engine = Engine(
        EngineConfig(target=model, device="cpu", dtype="float32", attention_backend="torch")
    )
    requests = [Request(i, [5, 6, 7], p) for i, p in enumerate(params)]
    for req in requests:
        engine.add(req)
    while engine.num_unfinished:
        engine.step()
    return [r.output.token_ids for r in requests]


def test_the_engine_samples_with_any_64_bit_seed_and_any_top_k(tiny_model: Path) -> None:
    """Seeds in [2^63, 2^64) and a top_k past int64 reach the sampler (greedy rows among them)."""
    base = SamplingParams(max_tokens=12, temperature=1.5)
    out = run_sampled(
        tiny_model,
        [
            replace(base, seed=2**64 - 1, top_k=2**64 - 1),
            replace(base, seed=2**64 - 1),
            replace(base, seed=2**63 + 5),
            replace(base, seed=5),
            replace(base, temperature=0.0, seed=2**64 - 1, top_k=2**64 - 1),
            replace(base, temperature=0.0),
        ],
    )
    assert out[0] == out[1]  # a top_k past the vocabulary keeps every token
    assert out[2] != out[3]  # bit 63 of the seed changes the draws
    assert out[4] == out[5]  # greedy ignores both

"""The Triton sampler against the torch sampler: Philox words bit for bit, then the tokens.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported) at tiny vocabularies with small blocks, so rows span several blocks; there numpy's log
stands in for libdevice's, so the noise is compared to a few ulps and the tokens exactly (a
flip would need two perturbed logits within an ulp). With CUDA every test runs on the GPU, where
the noise must match bit for bit, and the cases marked `gpu` add Qwen3's vocabulary at 512 rows.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from batchrun.sampling import sampler  # noqa: E402
from batchrun.sampling.philox import philox4x32_10, split64  # noqa: E402
from batchrun.sampling.sampler import SamplingBatch, gumbel_noise  # noqa: E402
from batchrun.sampling.triton_sampling import philox_debug, sample_plain  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu = pytest.mark.gpu
INT64_MIN = -(2**63)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _int64(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(INT64_MIN, 2**63 - 1, (n,), generator=gen, dtype=torch.int64)


def _batch(temperature: torch.Tensor, seed: torch.Tensor, step: torch.Tensor) -> SamplingBatch:
    n = len(temperature)
    return SamplingBatch(
        temperature=temperature.to(DEVICE),
        top_p=torch.ones(n, device=DEVICE),
        top_k=torch.zeros(n, dtype=torch.int64, device=DEVICE),
        seed=seed.to(DEVICE),
        step=step.to(DEVICE),
    )


def _torch_sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """sampler.sample on its torch path, the reference, on any device."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampler, "_plain_kernel", lambda logits: None)
        return sampler.sample(logits, batch)


def _mixed_batch(n: int, gen: torch.Generator) -> SamplingBatch:
    """Every third row greedy, the others at temperatures 0.3..2."""
    temperature = torch.rand(n, generator=gen) * 1.7 + 0.3
    temperature[::3] = 0
    return _batch(temperature, _int64(n, gen), _int64(n, gen))


def test_philox_words_match_the_torch_reference() -> None:
    gen = _gen(0)
    seeds = torch.tensor([0, INT64_MIN, -1, 1, 2**32, 2**32 - 1], dtype=torch.int64)
    steps = torch.tensor([0, 2**32 + 5, -1, 2**32 - 1, 7, 2**40 + 3], dtype=torch.int64)
    seeds, steps = torch.cat([seeds, _int64(2, gen)]), torch.cat([steps, _int64(2, gen)])
    edge = torch.tensor([0, 1, 63, 64, 1023, 1024, 151935, 2**31, 2**32 - 1])
    ids = torch.cat([edge, torch.randint(0, 2**32, (23,), generator=gen)]).expand(8, -1)
    ids = ids[torch.randperm(8, generator=gen)].contiguous()  # rows see ids in differing orders
    words, noise = philox_debug(seeds.to(DEVICE), steps.to(DEVICE), ids.to(DEVICE))

    key = tuple(w[:, None] for w in split64(seeds))
    s_lo, s_hi = (w[:, None].expand_as(ids) for w in split64(steps))
    expected = torch.stack(philox4x32_10((s_lo, s_hi, ids, torch.zeros_like(ids)), key), -1)
    assert torch.equal(words.cpu(), expected)

    reference = gumbel_noise(seeds.to(DEVICE), steps.to(DEVICE), ids.to(DEVICE))
    if DEVICE.type == "cuda":
        assert torch.equal(noise, reference)
    else:
        torch.testing.assert_close(noise, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("vocab", [37, 300, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tokens_match_the_torch_sampler(vocab: int, dtype: torch.dtype) -> None:
    gen = _gen(vocab)
    batch = _mixed_batch(8, gen)
    logits = (torch.randn(8, vocab, generator=gen) * 4).to(dtype).to(DEVICE)
    expected = _torch_sample(logits, batch)
    got = sample_plain(logits, batch.temperature, batch.seed, batch.step, block=64)
    assert torch.equal(got, expected)


def test_any_strides_and_the_default_block() -> None:
    gen = _gen(1)
    batch = _mixed_batch(6, gen)
    wide = (torch.randn(6, 1500, generator=gen) * 4).to(DEVICE)
    for logits in (wide[:, 200:1400], wide.t().contiguous().t()[:, :1300]):
        assert torch.equal(
            sample_plain(logits, batch.temperature, batch.seed, batch.step),
            _torch_sample(logits, batch),
        )


def test_greedy_rows_are_torch_argmax_ties_infinities_and_nan_included() -> None:
    inf, nan = float("inf"), float("nan")
    logits = torch.zeros(8, 300)
    logits[0, [5, 70, 299]] = 3.0  # ties across blocks: the first
    logits[1, [129, 130]] = 3.0  # ties inside a block
    logits[2] = -inf  # nothing finite: index 0
    logits[3, [40, 200]] = inf
    logits[4, [250, 90]] = nan  # NaN wins, the first one
    logits[4, 10] = inf
    logits[5, 299] = 1.0  # the last id
    logits[6, 64] = nan
    logits[7, :] = -1.0
    logits = logits.to(DEVICE)
    zeros = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    greedy = torch.zeros(8, device=DEVICE)
    got = sample_plain(logits, greedy, zeros, zeros, block=64)
    assert got.tolist() == [5, 129, 0, 40, 90, 299, 64, 0]
    assert torch.equal(got, logits.argmax(-1))
    # Sampled rows: non-finite logits stay non-finite after the noise, as in the torch path.
    batch = _batch(torch.ones(3), zeros[:3].cpu(), zeros[:3].cpu())
    sampled = sample_plain(logits[2:5], batch.temperature, batch.seed, batch.step, block=64)
    assert sampled.tolist() == [0, 40, 90]
    assert torch.equal(sampled, _torch_sample(logits[2:5], batch))


def test_out_is_written_without_allocating() -> None:
    gen = _gen(2)
    batch = _mixed_batch(5, gen)
    logits = torch.randn(5, 100, generator=gen).to(DEVICE)
    out = torch.full((5,), -1, dtype=torch.int64, device=DEVICE)
    got = sample_plain(logits, batch.temperature, batch.seed, batch.step, out=out)
    assert got is out and torch.equal(out, _torch_sample(logits, batch))
    empty = torch.empty(0, 100, device=DEVICE)
    none = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert sample_plain(empty, none.float(), none, none).shape == (0,)


def test_sample_with_the_kernel_matches_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """sampler.sample routed through the kernel (as on CUDA) for greedy, plain and filtered rows."""
    gen = _gen(3)
    n, vocab = 8, 200
    batch = _mixed_batch(n, gen)
    batch.top_k[1], batch.top_p[2], batch.top_k[3] = 5, 0.8, 3  # row 3 is greedy with a top-k
    logits = (torch.randn(n, vocab, generator=gen) * 3).to(DEVICE)
    expected = _torch_sample(logits, batch)
    calls: list[int] = []

    def kernel(*args: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return sample_plain(*args)

    monkeypatch.setattr(sampler, "_plain_kernel", lambda logits: kernel)
    assert torch.equal(sampler.sample(logits, batch), expected)
    assert calls == [1]


def _large(dtype: torch.dtype) -> tuple[torch.Tensor, SamplingBatch]:
    gen = _gen(4)
    logits = torch.randn(512, 151936, generator=gen).mul_(3).to(dtype).to(DEVICE)
    return logits, _mixed_batch(512, gen)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_qwen3_vocabulary(dtype: torch.dtype) -> None:
    logits, batch = _large(dtype)
    got = sample_plain(logits, batch.temperature, batch.seed, batch.step)
    assert torch.equal(got, _torch_sample(logits, batch))
    assert torch.equal(sampler.sample(logits, batch), got)  # sample() takes the kernel on CUDA


@gpu
def test_gpu_noise_is_bit_identical_over_the_vocabulary() -> None:
    _, batch = _large(torch.float32)
    seed, step = batch.seed[:16], batch.step[:16]
    ids = torch.arange(151936, device=DEVICE).expand(16, -1).contiguous()
    _, noise = philox_debug(seed, step, ids)
    assert torch.equal(noise, gumbel_noise(seed, step, ids[0]))


@gpu
def test_gpu_cuda_graph_replay() -> None:
    logits, batch = _large(torch.bfloat16)
    temperature, seed, step = batch.temperature.clone(), batch.seed.clone(), batch.step.clone()
    out = torch.empty(512, dtype=torch.int64, device=DEVICE)
    sample_plain(logits, temperature, seed, step, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample_plain(logits, temperature, seed, step, out=out)
    step.add_(1)
    graph.replay()
    shifted = SamplingBatch(batch.temperature, batch.top_p, batch.top_k, batch.seed, step)
    assert torch.equal(out, _torch_sample(logits, shifted))

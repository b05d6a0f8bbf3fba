"""The candidate selector's walk kernel (spec_decode/dflash2/triton_walk.py) against the torch
walk it replaces (walk.py's walk_torch): the same tokens, greedy and sampled, and q to a
tolerance; the uniforms the kernel draws itself; walk() choosing the kernel on CUDA; a CUDA
graph replay.

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported) at tiny shapes. Exact tokens need exact scores whatever the summation order: the
greedy case draws every input from multiples of 1/4 small enough that all sums are exact in
float32; the sampled case moves each uniform to the middle of the bin the torch walk chose, so
a last-bit difference in q cannot move the draw. With CUDA, the cases marked `gpu` add the real
selector's shapes (K 16, R 256, V 152k, P 15, N 1..128)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from batchrun.kernels import compile_check  # noqa: E402
from batchrun.sampling.draft_verify import proposal_uniforms  # noqa: E402
from batchrun.spec_decode.dflash2.triton_walk import walk_triton  # noqa: E402
from batchrun.spec_decode.dflash2.walk import Walk  # noqa: E402
from tests.helpers.dflash2_walk import Case, edges, seeded_walk, torch_walk  # noqa: E402
from tests.helpers.sm90 import compile_offline  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def quarters(gen: torch.Generator, *size: int, span: int = 8) -> torch.Tensor:
    """float32 multiples of 1/4 in [-span/4, span/4]: products and sums of a few hundred stay
    exact in float32."""
    return torch.randint(-span, span + 1, size, generator=gen).float() / 4


def make_inputs(
    n: int, p: int, k: int, r: int, v: int, seed: int, temperature: list[float] | None = None
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if v <= 10_000:
        picks = [torch.randperm(v, generator=gen)[:k] for _ in range(n * p)]
        ids = torch.stack(picks).view(n, p, k)
    else:  # a real vocabulary: a repeated candidate is unlikely and harmless to the walk
        ids = torch.randint(v, (n, p, k), generator=gen)
    if temperature is None:
        temps = torch.where(torch.arange(n) % 3 == 0, 0.0, 0.5 + torch.rand(n, generator=gen))
    else:
        temps = torch.tensor(temperature)
    made = {
        "unary": quarters(gen, n, p, k, span=40).sort(dim=-1, descending=True).values,
        "candidates": ids,
        "hidden_proj": quarters(gen, n, p, r),
        "anchors": torch.randint(v, (n,), generator=gen),
        "predecessor": quarters(gen, v, r, span=4),
        "successor": quarters(gen, v, r, span=4),
        "temperature": temps.float(),
        "uniforms": torch.rand(n, p, generator=gen).clamp_(min=2.0**-24),
    }
    return {name: t.to(DEVICE) for name, t in made.items()}


def kernel_walk(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """walk_triton of the case: with its uniforms, else drawing them from its rows' seed and
    first_step."""
    if "uniforms" in case:
        return walk_triton(edges(case), case["uniforms"])
    return walk_triton(edges(case), seed=case["seed"], first_step=case["first_step"])


def centred(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """x with each uniform moved to the middle of the CDF bin the torch walk draws (the same
    tokens from walk_torch, far from the bins' edges)."""
    ref = torch_walk(x)
    index = (x["candidates"] == ref.tokens[..., None]).int().argmax(dim=-1)
    cdf = ref.q.cumsum(dim=-1)
    upper = cdf.gather(-1, index[..., None]).squeeze(-1)
    lower = upper - ref.q.gather(-1, index[..., None]).squeeze(-1)
    middle = ((lower + upper) / 2 / cdf[..., -1]).float()
    return dict(x, uniforms=middle)


def assert_same_walk(got: tuple[torch.Tensor, torch.Tensor], want: Walk) -> None:
    tokens, q = got
    assert torch.equal(tokens, want.tokens)
    torch.testing.assert_close(q, want.q, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("n", "p", "k", "r", "v"),
    [(1, 1, 1, 1, 5), (3, 4, 4, 8, 40), (5, 7, 16, 20, 300), (2, 3, 5, 300, 64)],
)
def test_the_kernel_walks_greedy_rows_as_the_torch_walk(
    n: int, p: int, k: int, r: int, v: int
) -> None:
    x = make_inputs(n, p, k, r, v, seed=n * 7 + k, temperature=[0.0] * n)
    assert_same_walk(kernel_walk(x), torch_walk(x))


def test_the_kernel_breaks_ties_to_the_lower_candidate_index() -> None:
    x = make_inputs(3, 4, 5, 8, 40, seed=2, temperature=[0.0] * 3)
    x["unary"] = torch.zeros_like(x["unary"])
    x["successor"][:, 4:] = 0  # a few edges tie at every position
    x["predecessor"][:, :4] = 0
    tokens, q = kernel_walk(x)
    assert torch.equal(tokens, x["candidates"][:, :, 0])
    assert_same_walk((tokens, q), torch_walk(x))


@pytest.mark.parametrize(("n", "p", "k", "r", "v"), [(6, 5, 4, 8, 40), (4, 7, 16, 40, 300)])
def test_the_kernel_walks_sampled_and_greedy_rows_as_the_torch_walk(
    n: int, p: int, k: int, r: int, v: int
) -> None:
    x = centred(make_inputs(n, p, k, r, v, seed=p * 5 + n))
    assert_same_walk(kernel_walk(x), torch_walk(x))


def test_the_kernel_reads_strided_inputs_and_bfloat16_codebooks() -> None:
    x = make_inputs(4, 3, 4, 12, 50, seed=9)
    x["predecessor"] = x["predecessor"].bfloat16()  # quarters in [-1, 1]: exact in bfloat16
    x["successor"] = x["successor"].bfloat16()
    wide = {name: torch.cat([t, t], dim=-1) if t.dim() == 3 else t for name, t in x.items()}
    strided = dict(x, **{name: wide[name][..., : x[name].shape[-1]] for name in ("unary",)})
    strided["hidden_proj"] = x["hidden_proj"].transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided["unary"].is_contiguous() and not strided["hidden_proj"].is_contiguous()
    x = centred(x)
    strided["uniforms"] = x["uniforms"]
    assert_same_walk(kernel_walk(strided), torch_walk(x))


def coin_inputs(n: int, p: int, seed: int) -> dict[str, torch.Tensor]:
    """Sampled rows whose every position has two candidates of equal score: q = (1/2, 1/2)
    exactly, so a position takes its second candidate exactly when its uniform is >= 1/2 (the
    CDF's first step is 1/2, its total 1: no rounding) and the tokens spell the uniforms' top
    bits. Seeds span all 64 bits and steps pass 2^32, as the counter's words do."""
    x = make_inputs(n, p, 2, 4, 40, seed=seed, temperature=[1.0] * n)
    x["unary"] = torch.zeros_like(x["unary"])
    x["successor"] = torch.zeros_like(x["successor"])
    gen = torch.Generator().manual_seed(seed)
    del x["uniforms"]
    x["seed"] = torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen).to(DEVICE)
    steps = torch.randint(0, 2**40, (n,), generator=gen)
    steps[0] = 2**32 - 2  # its positions cross into the counter's high word
    x["first_step"] = steps.to(DEVICE)
    return x


def test_the_kernel_draws_the_proposal_streams_uniforms_itself() -> None:
    """Given seeds and steps instead of uniforms, the kernel's draws are those of
    proposal_uniforms (sampling/draft_verify.py), position by position."""
    x = coin_inputs(6, 5, seed=3)
    tokens, q = kernel_walk(x)
    assert torch.equal(q, torch.full_like(q, 0.5))
    second = proposal_uniforms(x["seed"], x["first_step"], 5) >= 0.5
    assert torch.equal(
        tokens, torch.where(second, x["candidates"][..., 1], x["candidates"][..., 0])
    )
    assert 0 < int(second.sum()) < second.numel()  # both halves drawn: the bits are compared


def walk_inputs(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The case with seeds in place of its uniforms (any: the draws differ from the case's)."""
    args = {name: t for name, t in x.items() if name != "uniforms"}
    n = x["unary"].shape[0]
    args["seed"] = torch.arange(n, device=DEVICE) * 977 + 5
    args["first_step"] = torch.arange(n, device=DEVICE) * 3
    return args


@pytest.mark.skipif(not compile_check.available(), reason="Triton's NVIDIA tools are missing")
def test_the_kernel_compiles_for_sm90_without_spills() -> None:
    """The compiler, not the interpreter: it refuses what the interpreter runs (a global that
    is no constexpr broke the kernel on the H100 once, with every interpreted test passing)."""
    run = compile_offline("tests/helpers/compile_dflash2_walk.py")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("'stack': 0") == 2, run.stdout


@pytest.mark.gpu
def test_walk_takes_the_kernel_on_cuda() -> None:
    x = make_inputs(8, 5, 16, 64, 1000, seed=1, temperature=[0.0] * 8)
    got = seeded_walk(walk_inputs(x))
    assert isinstance(got, Walk)
    assert_same_walk((got.tokens, got.q), torch_walk(x))
    coins = coin_inputs(32, 15, seed=8)
    drawn = seeded_walk(coins)
    second = proposal_uniforms(coins["seed"], coins["first_step"], 15) >= 0.5
    want = torch.where(second, coins["candidates"][..., 1], coins["candidates"][..., 0])
    assert torch.equal(drawn.tokens, want)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 32, 128])
def test_the_real_selector_shape(n: int) -> None:
    """K 16, R 256, a 152k vocabulary (bfloat16 codebooks), 15 draft positions."""
    x = make_inputs(n, 15, 16, 256, 151_936, seed=n)
    x["predecessor"] = x["predecessor"].bfloat16()
    x["successor"] = x["successor"].bfloat16()
    x = centred(x)
    assert_same_walk(kernel_walk(x), torch_walk(x))


@pytest.mark.gpu
def test_the_walk_replays_in_a_cuda_graph() -> None:
    x = walk_inputs(make_inputs(16, 15, 16, 256, 5000, seed=4, temperature=[0.0] * 16))
    static = {name: t.clone() for name, t in x.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            seeded_walk(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = seeded_walk(static)
    fresh = make_inputs(16, 15, 16, 256, 5000, seed=5, temperature=[0.0] * 16)
    for name, t in walk_inputs(fresh).items():
        static[name].copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_walk((out.tokens, out.q), torch_walk(fresh))

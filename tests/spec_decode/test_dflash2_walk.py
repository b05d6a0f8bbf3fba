"""DFlash2's proposal walk (spec_decode/dflash2/walk.py), the torch version: against a row-by-row
transcription of the selector's equation (docs/dflash.md, "DFlash2's walk"), its tie rule, its
sampled positions' q and inverse-CDF draw, and greedy and sampled rows in one batch."""

from __future__ import annotations

import torch

from batchrun.spec_decode.dflash2.walk import inverse_cdf
from tests.helpers.dflash2_walk import torch_walk


def make_inputs(
    n: int, p: int, k: int, r: int, v: int, seed: int, temperature: list[float]
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    picks = [torch.randperm(v, generator=gen)[:k] for _ in range(n * p)]
    return {
        "unary": (torch.randn(n, p, k, generator=gen) * 2).sort(dim=-1, descending=True).values,
        "candidates": torch.stack(picks).view(n, p, k),
        "hidden_proj": torch.randn(n, p, r, generator=gen),
        "anchors": torch.randint(v, (n,), generator=gen),
        "predecessor": torch.randn(v, r, generator=gen) / r**0.5,
        "successor": torch.randn(v, r, generator=gen),
        "temperature": torch.tensor(temperature),
        "uniforms": torch.rand(n, p, generator=gen).clamp_(min=2.0**-24),
    }


def row_by_row(x: dict[str, torch.Tensor]) -> tuple[list[list[int]], list[list[list[float]]]]:
    """The walk of each row alone, in float64, as the equation reads."""
    n, p, k = x["unary"].shape
    tokens, qs = [], []
    for row in range(n):
        previous = int(x["anchors"][row])
        t = float(x["temperature"][row])
        row_tokens, row_q = [], []
        for j in range(p):
            scores = []
            for c in range(k):
                cand = int(x["candidates"][row, j, c])
                edge = (
                    x["predecessor"][previous].double()
                    * x["hidden_proj"][row, j].double()
                    * x["successor"][cand].double()
                ).sum()
                scores.append(float(edge) + float(x["unary"][row, j, c]))
            if t == 0:
                best = max(range(k), key=lambda i: (scores[i], -i))
                q = [1.0 if i == best else 0.0 for i in range(k)]
                choice = best
            else:
                q = torch.tensor(scores, dtype=torch.float64).div(t).softmax(dim=0).tolist()
                u = float(x["uniforms"][row, j])
                cum, choice = 0.0, k - 1
                for i in range(k):
                    cum += q[i]
                    if cum >= u:
                        choice = i
                        break
            previous = int(x["candidates"][row, j, choice])
            row_tokens.append(previous)
            row_q.append(q)
        tokens.append(row_tokens)
        qs.append(row_q)
    return tokens, qs


def test_the_walk_follows_the_selector_equation_greedy_and_sampled() -> None:
    x = make_inputs(n=6, p=5, k=4, r=8, v=40, seed=3, temperature=[0, 1, 0.5, 0, 2, 1])
    out = torch_walk(x)
    tokens, qs = row_by_row(x)
    assert out.tokens.tolist() == tokens
    torch.testing.assert_close(out.q, torch.tensor(qs, dtype=torch.float32), atol=1e-5, rtol=0)
    assert out.tokens.dtype == torch.int64 and out.q.dtype == torch.float32


def test_the_first_position_is_scored_from_the_anchor() -> None:
    """Only the anchor's predecessor row decides position 0: changing it changes the edge."""
    x = make_inputs(n=1, p=1, k=3, r=2, v=5, seed=0, temperature=[0])
    x["unary"] = torch.zeros(1, 1, 3)
    x["hidden_proj"] = torch.ones(1, 1, 2)
    x["candidates"] = torch.tensor([[[0, 1, 2]]])
    x["successor"] = torch.tensor([[1.0, 0], [0, 1.0], [-1.0, -1.0], [0, 0], [0, 0]])
    x["predecessor"] = torch.tensor([[0, 0], [0, 0], [0, 0], [3.0, 0], [0, 3.0]])
    x["anchors"] = torch.tensor([3])
    assert torch_walk(x).tokens.tolist() == [[0]]
    x["anchors"] = torch.tensor([4])
    assert torch_walk(x).tokens.tolist() == [[1]]


def test_greedy_ties_go_to_the_lower_candidate_index() -> None:
    x = make_inputs(n=2, p=3, k=4, r=4, v=20, seed=1, temperature=[0, 0])
    x["unary"] = torch.zeros(2, 3, 4)
    x["successor"] = torch.zeros(20, 4)  # every edge scores 0: all K tie
    out = torch_walk(x)
    assert out.tokens.tolist() == x["candidates"][:, :, 0].tolist()
    assert out.q[:, :, 0].eq(1).all() and out.q[:, :, 1:].eq(0).all()


def test_the_walk_chains_each_chosen_token_into_the_next_edge() -> None:
    """A codebook where only the predecessor matters: each position's choice is determined by
    the previous position's."""
    v, r = 6, 6
    x = make_inputs(n=1, p=3, k=2, r=r, v=v, seed=2, temperature=[0])
    x["unary"] = torch.zeros(1, 3, 2)
    x["hidden_proj"] = torch.ones(1, 3, r)
    x["predecessor"] = torch.eye(v)
    # successor[c] = one-hot of the token that, as predecessor, favours c
    favoured_by = {1: 0, 2: 1, 3: 1, 4: 2, 5: 4}
    x["successor"] = torch.zeros(v, r)
    for c, prev in favoured_by.items():
        x["successor"][c, prev] = 1.0
    x["anchors"] = torch.tensor([0])
    x["candidates"] = torch.tensor([[[2, 1], [3, 2], [5, 4]]])
    # anchor 0 favours 1; 1 favours 3 (and 2, but 2 is not at position 1's top); 3 favours none
    # of position 2's: a tie, the lower index (5)
    assert torch_walk(x).tokens.tolist() == [[1, 3, 5]]


def test_inverse_cdf_picks_the_bin_holding_u_and_never_a_zero_mass_candidate() -> None:
    probs = torch.tensor([[0.25, 0.0, 0.5, 0.25, 0.0]] * 5)
    u = torch.tensor([0.1, 0.25, 0.26, 0.8, 1 - 2.0**-24])
    assert inverse_cdf(probs, u).tolist() == [0, 0, 2, 3, 3]
    # a total a little under 1 (float rounding) still maps u near 1 to the last non-zero bin
    under = torch.tensor([[0.3, 0.3, 0.3999, 0.0]])
    assert inverse_cdf(under, torch.tensor([0.99999994])).tolist() == [2]


def test_codebooks_in_bfloat16_are_read_in_float32() -> None:
    x = make_inputs(n=3, p=4, k=5, r=8, v=30, seed=5, temperature=[0, 1, 0.7])
    low = dict(x, predecessor=x["predecessor"].bfloat16(), successor=x["successor"].bfloat16())
    widened = dict(x, predecessor=low["predecessor"].float(), successor=low["successor"].float())
    a, b = torch_walk(low), torch_walk(widened)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.q, b.q)

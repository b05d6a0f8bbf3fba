"""Automatic prefix caching: the page pool's cache on its own, then whole jobs whose prompts
share prefixes, token-identical with the cache on and off (with a draft, round for round),
under preemption and eviction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from batchrun.engine.config import EngineConfig
from batchrun.engine.core.page_pool import PagePool
from batchrun.engine.core.requests import Request
from batchrun.engine.engine import Engine
from batchrun.sampling.params import SamplingParams
from tests.helpers.dflash_train import trained_draft_beside

PAGE = 4
pytestmark = pytest.mark.usefixtures("one_thread")


def test_full_pages_are_shared_and_idle_ones_evicted_least_recently_used() -> None:
    pool = PagePool(8, PAGE, prefix_caching=True)
    a = list(range(10))  # two full pages and a partial one
    pages_a: list[int] = []
    pool.grow(pages_a, len(a))
    pool.register(pages_a, a, 0, len(a))
    first, second = pages_a[:2]
    assert pool.match(a[:9]) == [first, second]  # the partial page is never cached
    pool.release(pages_a[:2].copy())  # the second holder lets go
    assert pool.match([0, 1, 2, 3, 9, 9, 9, 9]) == pages_a[:1]  # the prefix, then a mismatch
    pool.release(pages_a[:1].copy())
    pool.release(pages_a)
    assert pool.num_free == 8  # cached pages held by nobody still count as free
    # Taking pages uses unregistered ones first, then evicts the least recently used.
    taken: list[int] = []
    pool.grow(taken, 5 * PAGE)
    assert first not in taken and second not in taken
    pool.grow(taken, 7 * PAGE)
    assert first in taken and second not in taken  # the older idle page went first
    assert pool.match(a[:8]) == []  # the chain starts with the evicted page
    assert not pool.grow(taken, 9 * PAGE)


def test_a_page_in_use_is_never_evicted() -> None:
    pool = PagePool(3, PAGE, prefix_caching=True)
    tokens = list(range(8))
    held: list[int] = []
    pool.grow(held, 8)
    pool.register(held, tokens, 0, 8)
    other: list[int] = []
    assert pool.grow(other, PAGE)
    assert not pool.grow(other, 2 * PAGE)  # the only other pages are in use
    assert pool.match(tokens) == held


def test_a_duplicate_page_stays_private_and_caching_off_matches_nothing() -> None:
    pool = PagePool(8, PAGE, prefix_caching=True)
    tokens = list(range(8))
    first: list[int] = []
    second: list[int] = []
    pool.grow(first, 8)
    pool.grow(second, 8)
    pool.register(first, tokens, 0, 8)
    pool.register(second, tokens, 0, 8)
    assert pool.match(tokens) == first
    off = PagePool(8, PAGE)
    off.register(first, tokens, 0, 8)
    assert off.match(tokens) == []


def shared_prefix_jobs(
    count: int, seed: int, lengths: tuple[int, int]
) -> list[tuple[list[int], SamplingParams]]:
    """Prompts made of one of two shared prefixes and a short tail of their own; every third
    row sampled."""
    gen = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in lengths]
    jobs = []
    for i in range(count):
        tail = torch.randint(
            3, 1000, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen
        )
        params = SamplingParams(
            max_tokens=int(torch.randint(4, 20, (1,), generator=gen)),
            temperature=0.8 if i % 3 == 2 else 0.0,
            seed=i,
        )
        jobs.append((prefixes[i % 2] + tail.tolist(), params))
    return jobs


def run(target: Path, draft: Path | None, jobs: list, **config: Any) -> tuple[Engine, list]:
    settings = {"max_batch_size": 4, "max_batched_tokens": 64, "num_pages": 64} | config
    engine = Engine(
        EngineConfig(
            target=target,
            draft=draft,
            device="cpu",
            dtype="float32",
            attention_backend="torch",
            page_size=PAGE,
            verify_width="full",
            **settings,
        )
    )
    engine.instruments.rounds = []
    requests = [Request(i, p, params) for i, (p, params) in enumerate(jobs)]
    for req in requests:
        engine.add(req)
    while engine.num_unfinished:
        engine.step()
    return engine, requests


def rounds(engine: Engine) -> list:
    return sorted(engine.instruments.rounds or [], key=lambda t: (t.row_index, t.position))


@pytest.mark.parametrize(
    "draft_kind", [None, "", "sliding"], ids=["target-only", "dflash", "dflash-sliding"]
)
@pytest.mark.parametrize(
    ("num_pages", "lengths"),
    [(64, (21, 13)), (14, (21, 13)), (400, (250, 201))],
    ids=["roomy", "preempting", "long-prefixes"],  # long: whole page tables arrive in one step
)
def test_cached_prefixes_change_no_output(
    make_model: Any, draft_kind: str | None, num_pages: int, lengths: tuple[int, int]
) -> None:
    """A sliding draft's window is not in the cached pages (its rings hold it): a request
    admitted onto a cached prefix recomputes the window's worth of it, and drafts the same."""
    target = make_model(num_layers=4, vocab_size=1088, tie_word_embeddings=False)
    draft = trained_draft_beside(target, draft_kind) if draft_kind is not None else None
    jobs = shared_prefix_jobs(12, seed=3, lengths=lengths)
    off_engine, off = run(target, draft, jobs, prefix_caching=False, num_pages=num_pages)
    engine, on = run(target, draft, jobs, prefix_caching=True, num_pages=num_pages)
    assert [r.output.token_ids for r in on] == [r.output.token_ids for r in off]
    assert [r.output.spec_hist for r in on] == [
        r.output.spec_hist for r in off
    ]  # the draft's context too
    assert rounds(engine) == rounds(off_engine)  # every draft
    assert engine.pool.hit_rate is not None and engine.pool.hit_rate > 0.4
    assert engine.info()["prefix_cache_hit_rate"] == engine.pool.hit_rate  # into stats.json
    if num_pages == 14:
        assert engine.num_preemptions > 0

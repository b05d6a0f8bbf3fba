"""A hybrid target's state snapshots on the host: where a prefill stores them, a cache hit cut
back to the last page that has one, and a snapshot gone with its page or its slot's LRU turn."""

from __future__ import annotations

from batchrun.engine.core.page_pool import PagePool
from batchrun.engine.core.state_snapshots import STRIDE_PAGES, SnapshotPool, next_boundary

PAGE = 4


def test_boundaries_are_the_strides_then_the_prompts_last_reusable_page() -> None:
    stride = STRIDE_PAGES * PAGE
    prompt = 2 * stride + 7
    last = (prompt - 1) // PAGE * PAGE
    assert next_boundary(0, prompt, 1, PAGE, strided=True) == stride
    assert next_boundary(stride, prompt, 1, PAGE, strided=True) == 2 * stride
    assert next_boundary(2 * stride, prompt, 1, PAGE, strided=True) == last
    assert next_boundary(last, prompt, 1, PAGE, strided=True) is None
    assert next_boundary(0, prompt, 1, PAGE, strided=False) == last  # caching off: the fork
    assert next_boundary(0, 3, 1, PAGE, strided=True) is None  # no full page to reuse


def test_a_hit_stops_at_the_last_snapshot_and_eviction_takes_it_along() -> None:
    snapshots = SnapshotPool(1)
    pool = PagePool(4, PAGE, prefix_caching=True, snapshots=snapshots)
    tokens = list(range(3 * PAGE))
    pages: list[int] = []
    pool.grow(pages, len(tokens))
    pool.register(pages, tokens, 0, len(tokens))
    assert pool.match(tokens) == []  # cached pages, but no state to restart from
    slot = snapshots.store(pages[1])
    hit = pool.match(tokens)
    assert hit == pages[:2] and snapshots.get(pages[1]) == slot
    pool.release(hit)
    assert snapshots.store(pages[2]) == slot and not snapshots.has(pages[1])  # the LRU's slot
    pool.release(pages)  # cached, idle
    taken: list[int] = []
    pool.grow(taken, 4 * PAGE)  # every page: the cached ones evicted, their snapshot with them
    assert len(snapshots) == 0 and pool.match(tokens) == []

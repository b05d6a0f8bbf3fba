"""The order to admit a window of requests in, when the whole input is known ahead (a batch job).

Two aims, which one walk serves: rows that share a prompt prefix run side by side, so the pages
of that prefix are still held or cached when the next of them is admitted (prefix caching shares
full KV pages); and long requests start early, so the batch does not run nearly empty at the end
while the last long rows finish. The prompts form a trie of full KV pages; it is walked depth
first, taking at every branch the branch whose longest request is longest. The page size is the
engine's (EngineConfig.page_size): rows that share less than a page share no K/V. Outputs do not
change: sampling is keyed by each request's own seed and token index, whatever else runs beside
it.
"""

from __future__ import annotations

from batchrun.engine.core.requests import Request


def admission_order(requests: list[Request], max_len: int, page_size: int) -> list[Request]:
    """Depth first over the trie of prompt pages (of page_size tokens), the branch with the
    longest request first; a request's length is its prompt plus max_tokens, capped at the
    context max_len."""
    ordered = sorted(requests, key=lambda r: r.prompt_ids)  # every prefix group contiguous
    length = [min(len(r.prompt_ids) + r.params.max_tokens, max_len) for r in ordered]
    out: list[Request] = []
    todo = [(0, len(ordered))] if ordered else []  # ranges sharing a prefix, next one last
    while todo:
        lo, hi = todo.pop()
        first, last = ordered[lo].prompt_ids, ordered[hi - 1].prompt_ids
        if first == last:  # a leaf: one request, or identical prompts
            out.extend(ordered[lo:hi])
            continue
        branches = _branches(ordered, lo, hi, _shared_pages(first, last, page_size), page_size)
        branches.sort(key=lambda b: -max(length[b[0] : b[1]]))  # stable: ties stay sorted
        todo.extend(reversed(branches))
    return out


def _page(tokens: list[int], index: int, page_size: int) -> list[int]:
    return tokens[index * page_size : (index + 1) * page_size]


def _shared_pages(a: list[int], b: list[int], page_size: int) -> int:
    """Full pages at the start of both that are equal."""
    pages, full = 0, min(len(a), len(b)) // page_size
    while pages < full and _page(a, pages, page_size) == _page(b, pages, page_size):
        pages += 1
    return pages


def _branches(
    ordered: list[Request], lo: int, hi: int, depth: int, page_size: int
) -> list[tuple[int, int]]:
    """The ranges of ordered[lo:hi] (which share their first `depth` pages) whose page
    `depth` is the same."""
    branches, start = [], lo
    for i in range(lo + 1, hi + 1):
        if i == hi or _page(ordered[i].prompt_ids, depth, page_size) != _page(
            ordered[start].prompt_ids, depth, page_size
        ):
            branches.append((start, i))
            start = i
    return branches

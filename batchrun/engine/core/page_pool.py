"""Fixed-size KV pages handed out from a free list; a request holds a list of page ids.

Automatic prefix caching: once a step has been launched that writes a full page of prefilled
tokens, the page is registered under a digest of every token up to its end (a chain of
BLAKE2b digests, one per page), and a later request whose tokens start the same way takes those
pages instead of prefilling them. The draft's context K/V lives at the same slots, so it is
reused with them. A page can be held by several requests at once (a reference count); a
registered page that no request holds stays cached and is evicted, least recently used first,
only when the pool has no unregistered page left; a page in use is never evicted. Steps run in
order on one stream, so a page registered at launch is written before any later step reads it.

The samples of one row share their prompt's full pages the same way, by reference count, but
explicitly (`share`), so also with caching off.

A hybrid target's pool also keeps its recurrent-state snapshots (`snapshots`,
core/state_snapshots.py), each under the page it ends at: a match is cut back to the last page
that has one (the linear layers restart there), and a page's snapshot goes when the page is
freed or evicted.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np

from batchrun.engine.core.state_snapshots import SnapshotPool


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def page_digests(tokens: list[int], num_pages: int, page_size: int) -> list[bytes]:
    """Digest of tokens[: (i + 1) * page_size] for each of the first num_pages pages."""
    ids = np.asarray(tokens[: num_pages * page_size], dtype=np.int64)
    digests, prev = [], b""
    for i in range(num_pages):
        block = ids[i * page_size : (i + 1) * page_size].tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        digests.append(prev)
    return digests


class PagePool:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        prefix_caching: bool = False,
        snapshots: SnapshotPool | None = None,
    ) -> None:
        """snapshots: a hybrid target's recurrent-state snapshots (None: reuse needs none)."""
        self.num_pages, self.page_size = num_pages, page_size
        self.prefix_caching = prefix_caching
        self.snapshots = snapshots
        self._free: deque[int] = deque(range(num_pages))  # unregistered, held by nobody
        self._refs = [0] * num_pages
        self._digest_of: dict[int, bytes] = {}  # registered page -> its digest
        self._page_of: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # registered, held by nobody: LRU first
        self.queried_tokens = 0  # prompt tokens looked up in the cache
        self.hit_tokens = 0  # of those, found

    @property
    def num_free(self) -> int:
        """Pages a request can take: unheld ones, cached or not."""
        return len(self._free) + len(self._idle)

    @property
    def num_held(self) -> int:
        """Pages some request holds."""
        return sum(1 for n in self._refs if n)

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else None

    def extra_pages(self, pages: list[int], num_tokens: int) -> int:
        """Pages a request holding `pages` still needs to cover num_tokens positions."""
        return max(0, pages_for(num_tokens, self.page_size) - len(pages))

    def grow(self, pages: list[int], num_tokens: int) -> bool:
        """Extend `pages` in place to cover num_tokens positions; False if the pool is short."""
        need = self.extra_pages(pages, num_tokens)
        if need > self.num_free:
            return False
        pages.extend(self._take() for _ in range(need))
        return True

    def shrink(self, pages: list[int], num_tokens: int) -> None:
        """Give back the pages past num_tokens positions."""
        keep = pages_for(num_tokens, self.page_size)
        while len(pages) > keep:
            self._drop(pages.pop())

    def share(self, pages: list[int]) -> list[int]:
        """Pages another request holds, each now held once more (the samples of one row read
        their prompt's K/V from the same pages)."""
        for page in pages:
            assert self._refs[page] > 0, "only a page in use is shared"
            self._refs[page] += 1
        return list(pages)

    def release(self, pages: list[int]) -> None:
        for page in pages:
            self._drop(page)
        pages.clear()

    # -- prefix caching -----------------------------------------------------------------------

    def match(self, tokens: list[int]) -> list[int]:
        """The cached pages that hold the longest prefix of full pages of `tokens` (each now
        held once more); [] when caching is off."""
        if not self.prefix_caching:
            return []
        pages = []
        for digest in page_digests(tokens, len(tokens) // self.page_size, self.page_size):
            page = self._page_of.get(digest)
            if page is None:
                break
            if self._refs[page] == 0:
                del self._idle[page]
            self._refs[page] += 1
            pages.append(page)
        keep = self.restorable(pages)
        while len(pages) > keep:  # past the last restart point: they stay cached
            self._drop(pages.pop())
        return pages

    def restorable(self, pages: list[int]) -> int:
        """How many leading `pages` a request can start past: all of them, or for a hybrid
        target up to the last that has a state snapshot."""
        if self.snapshots is None:
            return len(pages)
        has = self.snapshots.has
        return next((k for k in range(len(pages), 0, -1) if has(pages[k - 1])), 0)

    def register(self, pages: list[int], tokens: list[int], start: int, end: int) -> None:
        """A launched step writes the K/V of tokens[start:end] into `pages`: register the full
        pages it completes (a page whose content another page already caches stays private)."""
        if not self.prefix_caching:
            return
        first, last = start // self.page_size, end // self.page_size
        digests = page_digests(tokens, last, self.page_size)
        for i in range(first, last):
            page, digest = pages[i], digests[i]
            if page in self._digest_of or digest in self._page_of:
                continue
            self._digest_of[page] = digest
            self._page_of[digest] = page

    def _take(self) -> int:
        if self._free:
            page = self._free.popleft()
        else:  # evict the least recently used cached page
            page, _ = self._idle.popitem(last=False)
            del self._page_of[self._digest_of.pop(page)]
            self._forget_state(page)
        self._refs[page] = 1
        return page

    def _drop(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if page in self._digest_of:
                self._idle[page] = None
            else:
                self._forget_state(page)
                self._free.append(page)

    def _forget_state(self, page: int) -> None:
        if self.snapshots is not None:
            self.snapshots.drop(page)

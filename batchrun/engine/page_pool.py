"""Fixed-size KV pages handed out from a free list; a request owns a list of page ids."""

from __future__ import annotations

from collections import deque


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def extra_pages(self, pages: list[int], num_tokens: int) -> int:
        """Pages a request holding `pages` still needs to cover num_tokens positions."""
        return max(0, pages_for(num_tokens, self.page_size) - len(pages))

    def grow(self, pages: list[int], num_tokens: int) -> bool:
        """Extend `pages` in place to cover num_tokens positions; False if the pool is short."""
        need = self.extra_pages(pages, num_tokens)
        if need > len(self._free):
            return False
        pages.extend(self._free.popleft() for _ in range(need))
        return True

    def shrink(self, pages: list[int], num_tokens: int) -> None:
        """Return the pages past num_tokens positions to the pool."""
        keep = pages_for(num_tokens, self.page_size)
        while len(pages) > keep:
            self._free.append(pages.pop())

    def release(self, pages: list[int]) -> None:
        self._free.extend(pages)
        pages.clear()

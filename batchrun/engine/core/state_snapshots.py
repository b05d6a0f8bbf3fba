"""Where a hybrid target's recurrent state is kept for reuse: a fixed pool of snapshot slots,
each holding the linear layers' state (conv and recurrent) as a prefill left it at a page
boundary, keyed by the KV page that ends there (engine/core/page_pool.py frees a page's
snapshot with the page). A cached prefix, or a sibling sample's shared prompt, can be reused
only up to a page that has one: the linear layers restart there from the snapshot, as a
full-attention layer restarts from the cached pages (vLLM's align mode).

A prefill stores a snapshot only at its boundaries (`next_boundary`): every STRIDE_PAGES pages
of the prompt when prefix caching is on (where other rows' shared prefixes end is unknown), and
the prompt's last page that a reuse can take (its n samples fork there, and a repeated prompt
or a preempted request restarts there). A chunk that would run past a boundary ends at it, so
its state is the boundary's. When every slot is taken, the least recently used snapshot makes
room: its page stays cached, no longer a restart point.

The device copies (engine/linear_slots.py) keep one order: a step's restores run before its
forward and its stores after it, so a snapshot reassigned in the same step is read before it is
overwritten, and one stored in a step is read by any later one.
"""

from __future__ import annotations

from collections import OrderedDict

# Pages between stored boundaries when prefix caching is on: each prompt holds at most one
# snapshot per STRIDE_PAGES pages (256 tokens at 16-token pages) and its chunks split there.
STRIDE_PAGES = 16


def next_boundary(
    num_cached: int, prompt_len: int, tail: int, page_size: int, *, strided: bool
) -> int | None:
    """The first boundary past num_cached where a prefill stores a snapshot (None: none is
    left): the multiples of STRIDE_PAGES pages (when `strided`) up to the prompt's last reusable
    page boundary, and that boundary (a reuse leaves `tail` tokens to compute)."""
    last = max(prompt_len - tail, 0) // page_size * page_size
    if num_cached >= last:
        return None
    if not strided:
        return last
    stride = STRIDE_PAGES * page_size
    return min((num_cached // stride + 1) * stride, last)


class SnapshotPool:
    """Host bookkeeping of the device's snapshot slots 0 .. num_slots - 1."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._of_page: OrderedDict[int, int] = OrderedDict()  # page -> slot, LRU first

    def __len__(self) -> int:
        """Snapshots held."""
        return len(self._of_page)

    def get(self, page: int) -> int | None:
        """The slot of the snapshot ending at `page`, now the most recently used; None: none."""
        slot = self._of_page.get(page)
        if slot is not None:
            self._of_page.move_to_end(page)
        return slot

    def has(self, page: int) -> bool:
        return page in self._of_page

    def store(self, page: int) -> int:
        """A slot for the snapshot ending at `page` (a step will copy the state into it), taken
        from the least recently used snapshot when none is free."""
        assert page not in self._of_page, "a page's state is stored once"
        slot = self._free.pop() if self._free else self._of_page.popitem(last=False)[1]
        self._of_page[page] = slot
        return slot

    def drop(self, page: int) -> None:
        """The page is freed or evicted: its snapshot's slot is free again."""
        slot = self._of_page.pop(page, None)
        if slot is not None:
            self._free.append(slot)

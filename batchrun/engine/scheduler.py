"""Continuous batching: which requests run in the next forward, and how many tokens each feeds.

Every step gives each running request past its prefill its decode (1 row) or verify (B rows)
step first; prefill chunks of running requests take what is left of the token budget, then new
requests are admitted in arrival order. At most max_batched_tokens // width requests run, so the
decode/verify rows always fit. Prefill chunks and admissions leave a reserve of free pages, the
pages of one decode/verify step for every request scheduled in the pass, so that taking pages
now does not preempt a request in the next step. When the pool still runs dry, the most recently
admitted request not yet scheduled in this pass is preempted: its pages are freed and it is
recomputed later from its tokens, which changes no output (sampling is keyed by position). A
request preempted in a pass waits at least until the next one.

The samples of one row (n > 1) share the full pages of their prompt, by reference count: the
first admitted prefills the prompt; the others wait, keeping their slots (later requests may go
ahead), until a running sibling has launched those pages, then take them and prefill only the
rest, at least the prompt's last token. A page is freed when its last holder lets go, so
preempting or finishing one sample never frees what another still reads; a preempted sample
shares again from a running sibling when it comes back, or prefills alone if none runs.

The engine launches a step before it reads the previous one's tokens, so a decoding request's
pages cover its in-flight rows too, and each running request holds a slot of the device state.
The engine may verify fewer than B rows in a step (the verify width): budgets and reserves are
those of full blocks, so a narrower step always fits; its pages still cover the full block the
draft writes (its K/V rows are read back within the step).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from batchrun.engine.config import check_batch_budget
from batchrun.engine.page_pool import PagePool, pages_for
from batchrun.engine.request import Request, Status


@dataclass
class Scheduled:
    req: Request
    num_new: int  # rows this request feeds to the target in this forward
    decoding: bool  # True: a decode/verify step; False: a prefill chunk


def prefill_len(req: Request) -> int:
    """Tokens to prefill before decoding: the prompt, or after a preemption every token but
    the newest (which the next decode/verify step feeds as its first row)."""
    return req.num_tokens - 1 if req.output_ids else len(req.prompt_ids)


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        max_batch_size: int,
        max_batched_tokens: int,
        decode_width: int,
        recompute_tail: int = 1,
        min_width: int | None = None,
    ) -> None:
        """recompute_tail: prefill tokens a request admitted onto a cached prefix computes at
        least (a draft with sliding-window layers refills its window from them); min_width:
        the narrowest verify width the engine may ask for (default decode_width), which bounds
        how many requests can decode in one step's token budget."""
        check_batch_budget(max_batched_tokens, decode_width)
        self.pool = pool
        self.recompute_tail = recompute_tail
        self.max_batched_tokens = max_batched_tokens
        self.decode_width = decode_width  # 1, or the draft's block size B
        self.max_running = min(max_batch_size, max_batched_tokens // (min_width or decode_width))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Pages kept free per request scheduled in a pass: its growth in the next step.
        self._step_pages = pages_for(decode_width, pool.page_size)
        self._planned: set[Request] = set()  # requests scheduled in this pass
        self._preempted: set[Request] = set()  # requests preempted in this pass
        self._free_slots = list(range(self.max_running - 1, -1, -1))
        self.admitted: list[Request] = []  # requests given a slot in this pass

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def prefill_pending(self) -> bool:
        """Whether the next step may carry prefill chunks: a running request has not finished
        its prefill, or a waiting one has a slot to take."""
        if self.waiting and len(self.running) < self.max_running:
            return True
        return any(req.num_cached < prefill_len(req) for req in self.running)

    def schedule(self, width: int | None = None) -> list[Scheduled]:
        """The next step; decoding requests feed `width` rows each (default: the full block);
        the caller keeps width * len(running) within the token budget."""
        self._planned, self._preempted, self.admitted = set(), set(), []
        width = width or self.decode_width
        batch: list[Scheduled] = []
        # A step that drafts writes the draft's whole block at the anchor, whatever it verifies.
        rows = self.decode_width if width > 1 else 1
        for req in list(self.running):  # oldest first; preempting the newest if pages run out
            decoding = req.status is Status.RUNNING and req.num_cached == prefill_len(req)
            if decoding and self._grow_or_preempt(req, req.in_flight + rows):
                batch.append(self._plan(req, width, decoding=True))
        budget = self.max_batched_tokens - width * len(batch)
        for req in list(self.running):
            if budget <= 0:
                break
            if req in self._planned or req.status is not Status.RUNNING:
                continue
            n = self._chunk(req, budget, self._step_pages * len(batch))
            if n <= 0 and not batch:  # nothing else can run: the oldest request goes on
                n = min(prefill_len(req) - req.num_cached, budget)
                n = n if self._grow_or_preempt(req, n) else 0
            if n > 0:
                batch.append(self._plan(req, n, decoding=False))
                budget -= n
        held: list[Request] = []  # samples waiting for a sibling's prompt pages, slots kept
        while self.waiting and len(self.running) + len(held) < self.max_running and budget > 0:
            req = self.waiting[0]
            if req in self._preempted:
                break
            shared = self._sibling_pages(req)
            if shared is None:
                held.append(self.waiting.popleft())
                continue
            looked_up = self._reuse_prefix(req, shared)
            n = self._chunk(req, budget, self._step_pages * len(batch))
            if n <= 0:
                self.pool.release(req.pages)  # cached pages it matched stay cached
                req.num_cached = 0
                break
            if looked_up:  # a cache lookup (a sibling's pages are shared without one)
                self.pool.queried_tokens += looked_up
                self.pool.hit_tokens += req.num_cached
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.slot = self._free_slots.pop()
            req.pages_on_device = 0  # a slot taken afresh: the step sends its whole table
            self.running.append(req)
            self.admitted.append(req)
            batch.append(self._plan(req, n, decoding=False))
            budget -= n
        self.waiting.extendleft(reversed(held))
        return batch

    def launched(self, batch: list[Scheduled]) -> None:
        """The step is on its way: its page-table entries are on the device, its decode rows
        in flight, its chunks' tokens hold K/V (their full pages join the prefix cache)."""
        for it in batch:
            req = it.req
            req.pages_on_device = len(req.pages)
            if it.decoding:
                req.in_flight += it.num_new
            else:
                start, req.num_cached = req.num_cached, req.num_cached + it.num_new
                prefix = req.token_slice(0, req.num_cached)
                self.pool.register(req.pages, prefix, start, req.num_cached)

    def landed(self, it: Scheduled) -> None:
        """A decoding request's rows were read back: no longer in flight."""
        it.req.in_flight -= it.num_new

    def keep(self, req: Request) -> None:
        """A request that goes on after a step: K/V past its committed tokens and the rows
        still in flight is released."""
        self.pool.shrink(req.pages, req.num_cached + req.in_flight)
        req.pages_on_device = min(req.pages_on_device, len(req.pages))

    def _sibling_pages(self, req: Request) -> list[int] | None:
        """The full pages of the prompt that a running sibling (a sample of the same row) has
        launched, for `req` to share (leaving recompute_tail tokens to compute): [] when no
        sibling runs or the prompt fills no page (req prefills it itself), None while the
        sibling is still prefilling them (req waits: a request admitted in the same step would
        prefill them again)."""
        shareable = min(prefill_len(req) - self.recompute_tail, len(req.prompt_ids))
        full = max(shareable, 0) // self.pool.page_size
        running = [s for s in req.siblings if s.status is Status.RUNNING]
        if not full or not running:
            return []
        source = max(running, key=lambda s: s.num_cached)
        if source.num_cached < full * self.pool.page_size:
            return None
        return source.pages[:full]

    def _reuse_prefix(self, req: Request, shared: list[int]) -> int:
        """Start a request being admitted from the pages its sibling shares, else from the
        longest cached prefix of its tokens (the pool's prefix cache); at least recompute_tail
        tokens are left to compute. Returns how many tokens were looked up in the cache."""
        if shared:
            req.pages = self.pool.share(shared)
            req.num_cached = len(shared) * self.pool.page_size
            return 0
        tokens = req.token_slice(0, max(prefill_len(req) - self.recompute_tail, 0))
        req.pages = self.pool.match(tokens)
        req.num_cached = len(req.pages) * self.pool.page_size
        return len(tokens)

    def _plan(self, req: Request, n: int, *, decoding: bool) -> Scheduled:
        self._planned.add(req)
        return Scheduled(req, n, decoding)

    def _chunk(self, req: Request, budget: int, reserve: int) -> int:
        """The prefill chunk the request takes now (as much of its prefill as the budget
        allows), its pages grown for it, if that leaves `reserve` pages free and, when the
        chunk completes the prefill, room for the request's first decode step; else 0."""
        remaining = prefill_len(req) - req.num_cached
        n = min(remaining, budget)
        end = req.num_cached + n + (self.decode_width if n == remaining else 0)
        if self.pool.extra_pages(req.pages, end) > self.pool.num_free - reserve:
            return 0
        self.pool.grow(req.pages, req.num_cached + n)
        return n

    def _grow_or_preempt(self, req: Request, num_new: int) -> bool:
        while not self.pool.grow(req.pages, req.num_cached + num_new):
            victim = next(r for r in reversed(self.running) if r not in self._planned)
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        self.restart(req)
        self._preempted.add(req)
        self.num_preemptions += 1

    def restart(self, req: Request) -> None:
        """Off the running list, first to come back: its K/V is recomputed from its tokens (a
        preempted request, or one whose tokens the host forced after its rounds launched)."""
        self._leave(req)
        req.num_cached = 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        self._leave(req)
        req.status = Status.FINISHED

    def _leave(self, req: Request) -> None:
        """Off the running list: pages and slot back, in-flight results to be dropped."""
        self.running.remove(req)
        self.pool.release(req.pages)
        self._free_slots.append(req.slot)
        req.slot, req.in_flight = -1, 0
        req.epoch += 1

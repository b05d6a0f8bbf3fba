"""Continuous batching: which requests run in the next forward, and how many tokens each feeds.

Every step packs, under one token budget, the running requests' decode (1 token) or verify
(B tokens) rows, chunks of prompts still being prefilled, and newly admitted requests. When the
page pool runs dry, the most recently admitted request is preempted: its pages are freed and it
is recomputed later from its tokens, which changes no output (sampling is keyed by position).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from batchrun.engine.page_pool import PagePool
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
        self, pool: PagePool, max_batch_size: int, max_batched_tokens: int, decode_width: int
    ) -> None:
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.max_batched_tokens = max_batched_tokens
        self.decode_width = decode_width  # 1, or the draft's block size B
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> list[Scheduled]:
        budget = self.max_batched_tokens
        batch: list[Scheduled] = []
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            item = self._plan(req, budget)
            if item is None:
                continue
            if not self._grow_or_preempt(req, item.num_new):
                continue
            batch.append(item)
            budget -= item.num_new
        while self.waiting and len(self.running) < self.max_batch_size and budget > 0:
            req = self.waiting[0]
            item = self._plan(req, budget)
            if item is None or not self.pool.grow(req.pages, req.num_cached + item.num_new):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            batch.append(item)
            budget -= item.num_new
        return batch

    def _plan(self, req: Request, budget: int) -> Scheduled | None:
        remaining = prefill_len(req) - req.num_cached
        if remaining > 0:
            return Scheduled(req, min(remaining, budget), decoding=False) if budget > 0 else None
        width = self.decode_width
        return Scheduled(req, width, decoding=True) if budget >= width else None

    def _grow_or_preempt(self, req: Request, num_new: int) -> bool:
        while not self.pool.grow(req.pages, req.num_cached + num_new):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.release(req.pages)
        req.num_cached = 0
        req.draft_cached = 0
        req.pending_features.clear()
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.release(req.pages)
        req.pending_features.clear()
        req.status = Status.FINISHED

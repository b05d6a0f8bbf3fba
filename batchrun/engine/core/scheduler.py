"""Continuous batching: which requests run in the next forward, and how many tokens each feeds
(`schedule` returns the step as one `ScheduledStep`), and what a step's results do to them
(`update_from_output` applies them in one place: the scheduler alone advances token progress).

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

On a hybrid target (the pool keeps state snapshots, core/state_snapshots.py) a request starts
past shared or cached pages only where a snapshot ends (its first chunk restores it), and a
prefill chunk ends at the next boundary its state is stored at.

`schedule` marks the step launched as it returns it (its items are snapshots of what the step's
plan needs: core/step.py). The engine launches a step before it reads the previous one's
tokens, so a decoding request's pages cover its in-flight rows too, and each running request
holds a slot of the device state.
The engine may verify fewer than B rows in a step (the verify width): budgets and reserves are
those of full blocks, so a narrower step always fits; its pages still cover the full block the
draft writes (its K/V rows are read back within the step).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchrun.engine.config import check_batch_budget
from batchrun.engine.core.page_pool import PagePool, pages_for
from batchrun.engine.core.requests import Request, RequestOutput, Status
from batchrun.engine.core.state_snapshots import next_boundary
from batchrun.engine.core.step import Scheduled, ScheduledStep, StepOutput
from batchrun.engine.core.stopping import Stopper
from batchrun.sampling.logprobs import asked_logprobs
from batchrun.spec_decode.acceptance import RoundTrace

if TYPE_CHECKING:
    from batchrun.sampling.row_grammar import RowGrammar


@dataclass(frozen=True)
class Recorded:
    """What a request records besides its tokens: speculation histograms over the draft's
    block (spec_block None: no draft) and log-probabilities (logprobs = k, prompt_logprobs =
    K; None: off)."""

    spec_block: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None


NOTHING_RECORDED = Recorded()

_Planned = tuple[Request, int, bool]  # a request scheduled in a pass: rows, decoding


def prefill_len(req: Request) -> int:
    """Tokens to prefill before decoding: the prompt, or after a preemption every token but
    the newest (which the next decode/verify step feeds as its first row)."""
    return req.num_tokens - 1 if req.output.token_ids else len(req.prompt_ids)


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        max_batch_size: int,
        max_batched_tokens: int,
        decode_width: int,
        recompute_tail: int = 1,
        min_width: int | None = None,
        recorded: Recorded = NOTHING_RECORDED,
        prefill_beside_decode: int | None = None,
    ) -> None:
        """recompute_tail: prefill tokens a request admitted onto a cached prefix computes at
        least (a draft with sliding-window layers refills its window from them); min_width:
        the narrowest verify width the engine may ask for (default decode_width), which bounds
        how many requests can decode in one step's token budget; recorded: what each request
        records besides its tokens; prefill_beside_decode: the most prefill tokens a step that
        decodes takes beside its decode rows (None: the rest of the token budget)."""
        check_batch_budget(max_batched_tokens, decode_width)
        self.pool = pool
        self.recompute_tail = recompute_tail
        self.max_batched_tokens = max_batched_tokens
        self.decode_width = decode_width  # 1, or the draft's block size B
        self.max_running = min(max_batch_size, max_batched_tokens // (min_width or decode_width))
        self.recorded = recorded
        self.prefill_beside_decode = prefill_beside_decode
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.decode_forwards = 0  # decode/verify rounds of a request, over every step
        self.decode_tokens = 0  # the tokens those rounds committed
        self.prompt_tokens_computed = 0  # prefill chunks' rows (cached or shared ones are not)
        # Pages kept free per request scheduled in a pass: its growth in the next step.
        self._step_pages = pages_for(decode_width, pool.page_size)
        self._planned: set[Request] = set()  # requests scheduled in this pass
        self._preempted: set[Request] = set()  # requests preempted in this pass
        self._free_slots = list(range(self.max_running - 1, -1, -1))

    def add(self, req: Request, grammar: RowGrammar | None = None) -> None:
        """Queue a request, its output made ready for what the job records; a constrained
        one comes with its compiled grammar."""
        output, recorded = req.output, self.recorded
        if grammar is not None:
            output.grammar = grammar
        if recorded.spec_block and output.spec_hist is None:
            output.spec_hist = [0] * recorded.spec_block
            output.spec_capped = [0] * recorded.spec_block
        if output.logprobs is None:
            output.logprobs = asked_logprobs(recorded.logprobs, recorded.prompt_logprobs)
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def tokens_per_round(self) -> float | None:
        """What speculation buys: tokens a decoding request commits per target forward."""
        return self.decode_tokens / self.decode_forwards if self.decode_forwards else None

    @property
    def prefill_pending(self) -> bool:
        """Whether the next step may carry prefill chunks: a running request has not finished
        its prefill, or a waiting one has a slot to take."""
        if self.waiting and len(self.running) < self.max_running:
            return True
        return any(req.state.num_cached < prefill_len(req) for req in self.running)

    def schedule(self, widths: Mapping[int, int] | int | None = None) -> ScheduledStep:
        """The next step, marked launched; each decoding request feeds its verify width's rows
        (widths: by slot, or one for all; default and slots left out: the full block); the
        caller keeps the widths' sum within the token budget."""
        self._planned, self._preempted = set(), set()
        batch: list[_Planned] = []
        admitted: list[Request] = []  # requests given a slot in this pass
        decoding = [req for req in self.running if self._decoding(req)]
        width = {req: self._width(req, widths) for req in decoding}
        # A step that drafts writes the draft's whole block at every decoding request's anchor,
        # whatever each verifies.
        rows = self.decode_width if any(w > 1 for w in width.values()) else 1
        for req in decoding:  # oldest first; preempting the newest if pages run out
            if self._decoding(req) and self._grow_or_preempt(req, req.state.in_flight + rows):
                batch.append(self._plan(req, width[req], decoding=True))
        budget = self.max_batched_tokens - sum(n for _, n, _ in batch)
        if batch and self.prefill_beside_decode is not None:
            budget = min(budget, self.prefill_beside_decode)
        for req in list(self.running):
            if budget <= 0:
                break
            if req in self._planned or req.state.status is not Status.RUNNING:
                continue
            n = self._chunk(req, budget, self._step_pages * len(batch))
            if n <= 0 and not batch:  # nothing else can run: the oldest request goes on
                n = self._chunk_len(req, budget)
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
            state = req.state
            looked_up = self._reuse_prefix(req, shared)
            n = self._chunk(req, budget, self._step_pages * len(batch))
            if n <= 0:
                self.pool.release(state.pages)  # cached pages it matched stay cached
                state.num_cached = 0
                break
            if looked_up:  # a cache lookup (a sibling's pages are shared without one)
                self.pool.queried_tokens += looked_up
                self.pool.hit_tokens += state.num_cached
            self.waiting.popleft()
            state.status = Status.RUNNING
            state.slot = self._free_slots.pop()
            state.pages_on_device = 0  # a slot taken afresh: the step sends its whole table
            self.running.append(req)
            admitted.append(req)
            batch.append(self._plan(req, n, decoding=False))
            budget -= n
        self.waiting.extendleft(reversed(held))
        items = self._items(batch, admitted)
        for it in items:
            self._launch(it)
        given = set(admitted)
        new = [it for it in items if it.req in given]
        return ScheduledStep(items=items, admitted=new)

    def _decoding(self, req: Request) -> bool:
        """Running and past its prompt (a preemption earlier in the pass stops it)."""
        state = req.state
        return state.status is Status.RUNNING and state.num_cached == prefill_len(req)

    def _width(self, req: Request, widths: Mapping[int, int] | int | None) -> int:
        if widths is None:
            return self.decode_width
        if isinstance(widths, int):
            return widths
        return widths.get(req.state.slot, self.decode_width)

    def _items(self, batch: list[_Planned], admitted: list[Request]) -> list[Scheduled]:
        """The step's snapshots; on a hybrid target with the state snapshots its chunks restore
        (taken first: a store may evict the least recently used) and store."""
        snapshots = self.pool.snapshots
        if snapshots is None:
            return [Scheduled.of(req, n, decoding=decoding) for req, n, decoding in batch]
        page_size, restore = self.pool.page_size, {}
        for req in admitted:
            if req.state.num_cached:  # past shared or cached pages: from the last one's state
                slot = snapshots.get(req.state.pages[req.state.num_cached // page_size - 1])
                assert slot is not None, "reuse stops at a page with a snapshot"
                restore[req] = slot
        items = []
        for req, n, decoding in batch:
            store, end = -1, req.state.num_cached + n
            if not decoding and end == self._boundary(req):
                page = req.state.pages[end // page_size - 1]
                store = -1 if snapshots.has(page) else snapshots.store(page)
            it = Scheduled.of(req, n, decoding=decoding, restore=restore.get(req, -1), store=store)
            items.append(it)
        return items

    def _boundary(self, req: Request) -> int | None:
        """A hybrid target's next state boundary past the request's cached tokens."""
        state, pool = req.state, self.pool
        return next_boundary(
            state.num_cached,
            len(req.prompt_ids),
            self.recompute_tail,
            pool.page_size,
            strided=pool.prefix_caching,
        )

    def _launch(self, it: Scheduled) -> None:
        """The step goes on its way as scheduled: its page-table entries will be on the device,
        its decode rows in flight, its chunks' tokens hold K/V (their full pages join the
        prefix cache). The next pass plans from here."""
        state = it.req.state
        state.pages_on_device = len(state.pages)
        if it.decoding:
            state.in_flight += it.num_new
        else:
            start, state.num_cached = state.num_cached, state.num_cached + it.num_new
            self.prompt_tokens_computed += it.num_new
            prefix = it.req.token_slice(0, state.num_cached)
            self.pool.register(state.pages, prefix, start, state.num_cached)

    def update_from_output(
        self,
        output: StepOutput,
        *,
        stopper: Stopper,
        rounds: list[RoundTrace] | None = None,
    ) -> list[Request]:
        """Apply a step's results read back by the host: commit each request's tokens under
        the stop rules (with their log-probabilities, speculation statistics and grammar),
        advance its token progress, then finish, restart or keep it. A result launched under
        an older epoch (finished or preempted since) is dropped. Returns the finished ones;
        rounds: when a list, every verify round is appended to it."""
        finished, pos, dec = [], 0, 0
        d, scores = output.num_drafts, output.scores
        for i, it in enumerate(output.items):
            req, k = it.req, it.num_sampled
            post = output.tokens[pos : pos + k]
            pos += k
            if it.decoding:
                dec += 1
            if req.state.epoch != it.epoch:  # finished or preempted since: the result drops
                continue
            out = req.output
            before = len(out.token_ids)
            if it.decoding:
                req.state.in_flight -= it.num_new  # read back: no longer in flight
                drafted = output.drafts[(dec - 1) * d : (dec - 1) * d + min(d, it.num_new - 1)]
                accepted = output.accepted[dec - 1]
                self._commit_round(req, post, accepted, drafted, it.num_new, stopper, rounds)
            elif post:  # the first token, sampled from the prompt's last row
                stopper.commit(req, post)
            if scores is not None:  # the rows of the tokens kept (stop rules cut the rest)
                scores.commit(out.logprobs, i, pos - k, len(out.token_ids) - before)
            if out.grammar is not None:  # the grammar follows the committed output
                forced = len(stopper.think_end) if out.forced else 0
                out.grammar.commit(out.token_ids[before:], forced)
            if out.finish_reason:
                self.finish(req)
                finished.append(req)
            elif out.forced:  # forced tokens (a thinking budget): resume from them
                out.forced = False
                self.restart(req)
            else:
                self._keep(req)
        return finished

    def _commit_round(
        self,
        req: Request,
        post: list[int],
        acc: int,
        drafts: list[int],
        width: int,
        stopper: Stopper,
        rounds: list[RoundTrace] | None,
    ) -> None:
        """Commits post[0 .. acc] (acc accepted drafts plus the target's own next token)."""
        state, out = req.state, req.output
        p, anchor = state.num_cached, out.token_ids[-1]
        kept = stopper.commit(req, post[: acc + 1])
        state.num_cached = p + acc + 1  # anchor .. d_acc now hold target KV; the bonus is next
        self.decode_forwards += 1
        self.decode_tokens += kept
        if out.spec_hist is not None and out.spec_capped is not None:
            if width > 1:  # a speculation round (width 1 is plain decoding: it drafts nothing)
                _count_round(out, kept, capped=acc == width - 1 and kept == width)
            if rounds is not None:
                committed = out.token_ids[len(out.token_ids) - kept :]
                rounds.append(RoundTrace(req.row_index, p, anchor, drafts, committed))

    def _keep(self, req: Request) -> None:
        """A request that goes on after a step: K/V past its committed tokens and the rows
        still in flight is released."""
        state = req.state
        self.pool.shrink(state.pages, state.num_cached + state.in_flight)
        state.pages_on_device = min(state.pages_on_device, len(state.pages))

    def _sibling_pages(self, req: Request) -> list[int] | None:
        """The full pages of the prompt that a running sibling (a sample of the same row) has
        launched, for `req` to share (leaving recompute_tail tokens to compute): [] when no
        sibling runs or the prompt fills no page (req prefills it itself), None while the
        sibling is still prefilling them (req waits: a request admitted in the same step would
        prefill them again)."""
        shareable = min(prefill_len(req) - self.recompute_tail, len(req.prompt_ids))
        full = max(shareable, 0) // self.pool.page_size
        running = [s for s in req.siblings if s.state.status is Status.RUNNING]
        if not full or not running:
            return []
        source = max(running, key=lambda s: s.state.num_cached)
        if source.state.num_cached < full * self.pool.page_size:
            return None
        pages = source.state.pages[:full]
        return pages[: self.pool.restorable(pages)]  # a hybrid's: up to its prompt's snapshot

    def _reuse_prefix(self, req: Request, shared: list[int]) -> int:
        """Start a request being admitted from the pages its sibling shares, else from the
        longest cached prefix of its tokens (the pool's prefix cache); at least recompute_tail
        tokens are left to compute. Returns how many tokens were looked up in the cache."""
        state = req.state
        if shared:
            state.pages = self.pool.share(shared)
            state.num_cached = len(shared) * self.pool.page_size
            return 0
        tokens = req.token_slice(0, max(prefill_len(req) - self.recompute_tail, 0))
        state.pages = self.pool.match(tokens)
        state.num_cached = len(state.pages) * self.pool.page_size
        return len(tokens)

    def _plan(self, req: Request, n: int, *, decoding: bool) -> _Planned:
        self._planned.add(req)
        return req, n, decoding

    def _chunk(self, req: Request, budget: int, reserve: int) -> int:
        """The prefill chunk the request takes now (as much of its prefill as the budget
        allows), its pages grown for it, if that leaves `reserve` pages free and, when the
        chunk completes the prefill, room for the request's first decode step; else 0."""
        state = req.state
        remaining = prefill_len(req) - state.num_cached
        n = self._chunk_len(req, budget)
        end = state.num_cached + n + (self.decode_width if n == remaining else 0)
        if self.pool.extra_pages(state.pages, end) > self.pool.num_free - reserve:
            return 0
        self.pool.grow(state.pages, state.num_cached + n)
        return n

    def _chunk_len(self, req: Request, budget: int) -> int:
        """As much of the request's prefill as the budget allows, ending at the next state
        boundary if it would pass one (a hybrid target's)."""
        n = min(prefill_len(req) - req.state.num_cached, budget)
        boundary = self._boundary(req) if self.pool.snapshots is not None else None
        return n if boundary is None else min(n, boundary - req.state.num_cached)

    def _grow_or_preempt(self, req: Request, num_new: int) -> bool:
        while not self.pool.grow(req.state.pages, req.state.num_cached + num_new):
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
        req.state.num_cached = 0
        req.state.status = Status.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        self._leave(req)
        req.state.status = Status.FINISHED

    def fail(self, req: Request, error: str) -> None:
        """Finish a request never queued as an error (its grammar did not compile)."""
        req.output.finish_reason, req.output.error = "error", error
        req.state.status = Status.FINISHED

    def abort_all(self) -> None:
        """Drop every unfinished request and free its pages."""
        for req in list(self.running):
            self.finish(req)
        for req in self.waiting:  # preempted ones may hold no pages; fresh ones none
            self.pool.release(req.state.pages)
        self.waiting.clear()

    def _leave(self, req: Request) -> None:
        """Off the running list: pages and slot back, in-flight results to be dropped."""
        state = req.state
        self.running.remove(req)
        self.pool.release(state.pages)
        self._free_slots.append(state.slot)
        state.slot, state.in_flight = -1, 0
        state.epoch += 1


def _count_round(out: RequestOutput, kept: int, *, capped: bool) -> None:
    """A speculation round that committed `kept` tokens; capped: it accepted every draft it
    verified."""
    assert out.spec_hist is not None and out.spec_capped is not None
    out.spec_rounds += 1
    out.spec_hist[kept - 1] += 1
    if capped:
        out.spec_capped[kept - 1] += 1

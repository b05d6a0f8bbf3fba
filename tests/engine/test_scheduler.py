"""The scheduler on its own, stepped by a model-free stand-in for the engine, and the engine on a
tiny checkpoint: every decoding request gets its decode/verify rows every step, a token budget
below the verify width is refused, a request preempted in a pass is not re-admitted in it, and
admission leaves room for the running requests' next step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchrun.cli import cli
from batchrun.engine.config import EngineConfig, check_batch_budget
from batchrun.engine.core.page_pool import PagePool
from batchrun.engine.core.requests import Request
from batchrun.engine.core.scheduler import Scheduler, prefill_len
from batchrun.engine.core.step import Scheduled
from batchrun.engine.engine import Engine
from batchrun.errors import JobError
from batchrun.sampling.params import SamplingParams
from batchrun.tools.tiny_draft import make_tiny_draft
from tests.helpers.engine_runs import cpu_engine

# Prompt lengths and max_tokens of the engine's preemption test (tests/test_engine_oracle.py).
PROMPTS = [1, 2, 5, 9, 16, 23, 37, 50, 9, 30]
MAX_TOKENS = [20, 12, 24, 16, 20, 8, 20, 16, 20, 18]


@dataclass
class Trace:
    """What a simulated job did: preemptions per pass and the steps' batches."""

    preempted: list[list[Request]] = field(default_factory=list)
    batches: list[list[Scheduled]] = field(default_factory=list)
    decoding_before: list[list[Request]] = field(default_factory=list)


def simulate(
    prompts: list[int],
    max_tokens: list[int],
    *,
    num_pages: int,
    page_size: int = 4,
    max_batch_size: int = 8,
    max_batched_tokens: int = 64,
    width: int = 1,
    accepted: Callable[[Request, int], int] = lambda req, step: 1,
    prefill_beside_decode: int | None = None,
) -> tuple[Scheduler, Trace]:
    """Steps the scheduler as the engine does, with a stand-in model: a verify round commits
    `accepted(req, step)` tokens, capped by max_tokens; the KV past them is released. Each step
    is read back before the next (`schedule` advanced the chunks' progress and put the verify
    rows in flight)."""
    pool = PagePool(num_pages, page_size)
    scheduler = Scheduler(
        pool,
        max_batch_size,
        max_batched_tokens,
        decode_width=width,
        prefill_beside_decode=prefill_beside_decode,
    )
    for i, (n, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        scheduler.add(Request(i, [3] * n, SamplingParams(max_tokens=m)))
    trace = Trace()
    preempt = scheduler.preempt

    def record(req: Request) -> None:
        trace.preempted[-1].append(req)
        preempt(req)

    scheduler.preempt = record  # type: ignore[method-assign]
    for step in range(10_000):
        if not scheduler.num_unfinished:
            break
        trace.decoding_before.append(
            [r for r in scheduler.running if r.state.num_cached == prefill_len(r)]
        )
        trace.preempted.append([])
        batch = scheduler.schedule().items
        trace.batches.append(batch)
        for it in batch:
            req = it.req
            if it.decoding:
                k = min(accepted(req, step), it.num_new)
                req.output.token_ids += [7] * min(
                    k, req.params.max_tokens - len(req.output.token_ids)
                )
                req.state.num_cached += k
                req.state.in_flight -= it.num_new
            else:
                if not req.output.token_ids and req.state.num_cached == len(req.prompt_ids):
                    req.output.token_ids.append(7)  # the first token, from the prompt's last row
            if len(req.output.token_ids) >= req.params.max_tokens:
                scheduler.finish(req)
            else:
                pool.shrink(req.state.pages, req.state.num_cached)
    assert not scheduler.num_unfinished, "the job did not finish"
    assert pool.num_free == num_pages
    return scheduler, trace


@pytest.mark.parametrize("max_batched_tokens", [64, 7])
def test_a_request_preempted_in_a_pass_is_not_readmitted_in_it(max_batched_tokens: int) -> None:
    _, trace = simulate(PROMPTS, MAX_TOKENS, num_pages=20, max_batched_tokens=max_batched_tokens)
    assert any(trace.preempted)
    for victims, batch in zip(trace.preempted, trace.batches, strict=True):
        assert not {id(r) for r in victims} & {id(it.req) for it in batch}


@pytest.mark.parametrize("max_batched_tokens,most", [(64, 3), (7, 3)])
def test_admission_keeps_a_reserve_so_fewer_requests_are_preempted(
    max_batched_tokens: int, most: int
) -> None:
    """The engine's preemption scenario (20 pages of 4 tokens; about 300 needed) took 6 and 15
    preemptions when requests were admitted into the pages the running ones grow into next, and
    victims were re-admitted in the pass that preempted them."""
    scheduler, _ = simulate(
        PROMPTS, MAX_TOKENS, num_pages=20, max_batched_tokens=max_batched_tokens
    )
    assert 0 < scheduler.num_preemptions <= most


def test_every_decoding_request_verifies_every_step() -> None:
    """Block size 4, 10 tokens a forward, 8 requests allowed: 2 run at once, and each of them
    feeds its 4 verify rows in every step, prefill chunks taking what is left."""
    width = 4
    _, trace = simulate(
        [3, 9, 14, 2, 6, 21, 5, 8],
        [9, 5, 12, 7, 3, 10, 6, 4],
        num_pages=64,
        max_batched_tokens=10,
        width=width,
        accepted=lambda req, step: 1 + (req.row_index + step) % width,
    )
    for decoding, batch in zip(trace.decoding_before, trace.batches, strict=True):
        verified = [it.req for it in batch if it.decoding]
        assert {id(r) for r in verified} == {id(r) for r in decoding}
        assert all(it.num_new == width for it in batch if it.decoding)
        assert len({id(it.req) for it in batch}) <= 10 // width
        assert sum(it.num_new for it in batch) <= 10


def test_a_decoding_step_takes_at_most_its_prefill_beside_decode() -> None:
    """Stall-free batching: a step with decode rows carries at most 6 prompt tokens beside
    them; a step with none takes the whole budget; every request still finishes, and its rows
    start decoding one after another rather than together."""
    prompts, max_tokens = [40] * 6, [10] * 6
    scheduler, trace = simulate(
        prompts, max_tokens, num_pages=200, max_batched_tokens=64, prefill_beside_decode=6
    )
    assert scheduler.num_unfinished == 0
    prefill = [sum(it.num_new for it in b if not it.decoding) for b in trace.batches]
    decoding = [any(it.decoding for it in b) for b in trace.batches]
    assert all(p <= 6 for p, d in zip(prefill, decoding, strict=True) if d)
    assert any(p > 6 for p, d in zip(prefill, decoding, strict=True) if not d)
    assert any(p and d for p, d in zip(prefill, decoding, strict=True))  # steps mix both
    # Without it the same job prefills 64 tokens beside its decode rows.
    _, plain = simulate(prompts, max_tokens, num_pages=200, max_batched_tokens=64)
    first = [
        next(
            i
            for i, b in enumerate(t.batches)
            if any(it.decoding and it.req.row_index == r for it in b)
        )
        for t in (trace, plain)
        for r in range(len(prompts))
    ]
    capped, whole = first[: len(prompts)], first[len(prompts) :]
    assert max(capped) - min(capped) > max(whole) - min(whole)  # staggered starts


def test_a_budget_below_the_verify_width_is_refused() -> None:
    with pytest.raises(JobError, match="max_batched_tokens 15 .* block size 16"):
        check_batch_budget(15, 16)
    check_batch_budget(16, 16)
    check_batch_budget(1, 1)
    with pytest.raises(JobError):
        Scheduler(PagePool(8, 4), 4, 3, decode_width=4)


def test_a_narrow_verify_step_has_pages_for_the_whole_draft_block() -> None:
    """Block size 8, a step verifying 2 rows: the draft writes its whole block at the anchor,
    so the pages cover 8 positions past it; a plain decode step (width 1) drafts nothing."""
    pool = PagePool(16, 4)
    scheduler = Scheduler(pool, 4, 64, decode_width=8)
    req = Request(0, [3] * 5, SamplingParams(max_tokens=20))
    scheduler.add(req)
    scheduler.schedule(2)  # the prefill
    req.state.num_cached, req.output.token_ids = 5, [7]
    [step] = scheduler.schedule(2).items
    assert (step.decoding, step.num_new) == (True, 2) and len(
        req.state.pages
    ) == 4  # 5 + 8 positions
    pool.shrink(req.state.pages, 5)
    scheduler.schedule(1)
    assert len(req.state.pages) == 2  # 5 + 1


@pytest.mark.parametrize(("tail", "reused"), [(1, 36), (7, 32)])
def test_a_cached_prompt_leaves_its_tail_to_recompute(tail: int, reused: int) -> None:
    """A 40-token prompt whose every page is cached: a request admitted onto it computes at
    least `tail` tokens (a draft with a sliding window of W recomputes W - 1, whose target
    features refill its ring), in whole pages of 4."""
    pool = PagePool(32, 4, prefix_caching=True)
    tokens = list(range(3, 43))
    pages: list[int] = []
    pool.grow(pages, 40)
    pool.register(pages, tokens, 0, 40)
    pool.release(pages)
    scheduler = Scheduler(pool, 4, 64, decode_width=4, recompute_tail=tail)
    req = Request(0, tokens, SamplingParams())
    scheduler.add(req)
    [chunk] = scheduler.schedule().items
    # It starts after the reused tokens (its state has moved on: `schedule` launched the chunk).
    assert chunk.num_new == 40 - reused and chunk.start == reused
    assert pool.hit_tokens == reused


def run_to_end(e: Engine, prompts: list[list[int]], max_tokens: list[int]) -> list[Request]:
    requests = [
        Request(i, p, SamplingParams(max_tokens=m))
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    for req in requests:
        e.add(req)
    for _ in range(10_000):
        if not e.num_unfinished:
            break
        e.step()
    assert not e.num_unfinished
    return requests


def test_the_engine_runs_with_a_budget_of_one_verify_block(
    tmp_path: Path, tiny_model: Path
) -> None:
    """max_batched_tokens = B runs to the end (one request verifies at a time, the output is
    the target's own); B - 1 is refused at construction and, in one line, by `batchrun run`."""
    block = 4
    draft = make_tiny_draft(tmp_path / "draft", tiny_model, block_size=block)
    prompts = [[5 + i, 9, 11 + i] for i in range(4)]
    max_tokens = [9, 4, 12, 7]
    plain = run_to_end(cpu_engine(tiny_model, None, num_pages=64), prompts, max_tokens)
    narrow = run_to_end(
        cpu_engine(tiny_model, draft, num_pages=64, max_batched_tokens=block), prompts, max_tokens
    )
    assert [r.output.token_ids for r in narrow] == [r.output.token_ids for r in plain]
    with pytest.raises(JobError, match=f"max_batched_tokens {block - 1}"):
        cpu_engine(tiny_model, draft, max_batched_tokens=block - 1)

    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"prompt": ["def f(x):"]}), tmp_path / "in" / "0.parquet")
    job = tmp_path / "job.toml"
    job.write_text(
        f'input = "in"\noutput = "out"\ntarget = "{tiny_model}"\ndraft = "{draft}"\n'
        f"quiet = true\nmax_batched_tokens = {block - 1}\n"
    )
    result = CliRunner().invoke(cli, ["run", str(job)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and f"max_batched_tokens {block - 1}" in lines[0], result.stderr


def test_fewer_preemptions_and_the_same_outputs_in_the_engine(make_model: Any) -> None:
    """The oracle test's preemption scenario on the engine (6 preemptions before with 64 tokens a
    forward): outputs equal those of a pool large enough to preempt nothing."""
    model = make_model(num_kv_heads=4, tie_word_embeddings=False, num_shards=2)
    prompts = [[(7 * i + j) % 900 + 3 for j in range(n)] for i, n in enumerate(PROMPTS)]
    roomy = run_to_end(cpu_engine(model, None, num_pages=256), prompts, MAX_TOKENS)
    for chunk, most in ((64, 3), (7, 9)):
        tight = cpu_engine(model, None, num_pages=20, max_batched_tokens=chunk)
        requests = run_to_end(tight, prompts, MAX_TOKENS)
        assert [r.output.token_ids for r in requests] == [r.output.token_ids for r in roomy]
        assert 0 < tight.num_preemptions <= most, chunk


def test_abort_all_frees_every_page(tiny_model: Path) -> None:
    """`batchrun bench` drops its requests between points: running and waiting alike."""
    from batchrun.engine.core.requests import Request
    from batchrun.engine.engine import Engine
    from batchrun.sampling.params import SamplingParams

    engine = Engine(EngineConfig(target=tiny_model, device="cpu", max_batch_size=2, num_pages=32))
    for i in range(5):
        engine.add(Request(i, [5, 6, 7, 8, 9], SamplingParams(max_tokens=50)))
    engine.step()
    engine.step()
    assert engine.scheduler.running and engine.scheduler.waiting
    engine.abort_all()
    assert engine.num_unfinished == 0 and engine.pool.num_free == 32

"""The engine: load the models, then step the continuous batch until every request finishes.

One step = (draft forward, when a draft is loaded) + one target forward over every scheduled
request's rows: prefill chunks, plain decode rows, or DFlash verify blocks. A plain decode step
is a verify round of width 1 that drafts nothing, so both paths share one commit rule. Sampling,
acceptance and the commit into the per-slot device state run on the device; one small copy per
step brings back what was committed.

Steps overlap: step N+1 is scheduled and launched before the host reads step N's tokens (its
inputs come from the device state, which step N updates on the device), so the host's work of
committing, stop checks and scheduling runs while the GPU computes. A request that step N
finishes or a preemption drops runs once more in step N+1; that result is dropped.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from batchrun.attention.choice import MEASURED_CONTEXT, Workload
from batchrun.engine.config import EngineConfig, check_batch_budget, verify_widths
from batchrun.engine.cuda_graphs import ladder_bucket
from batchrun.engine.device_state import to_host
from batchrun.engine.heap import collect_everything, freeze_heap
from batchrun.engine.loading import (
    attention_backend,
    eos_token_ids,
    load_tokenizer,
    resolve_device,
)
from batchrun.engine.logprobs import (
    PromptRows,
    ReadLogprobs,
    StepLogprobs,
    asked_logprobs,
    prompt_rows,
    score_step,
)
from batchrun.engine.memory import job_kv_pages, usable_context
from batchrun.engine.model_runner import ModelRunner, TargetOutput
from batchrun.engine.page_pool import PagePool
from batchrun.engine.request import Request, sample_requests
from batchrun.engine.sampler import sample
from batchrun.engine.scheduler import Scheduled, Scheduler
from batchrun.engine.startup import StartupClock
from batchrun.engine.step_inputs import plan_step, rows_sampled
from batchrun.engine.step_timer import StepTimer
from batchrun.engine.stopping import Stopper
from batchrun.errors import JobError
from batchrun.layers.ops import use_ops
from batchrun.models.dflash import DFlashDraft
from batchrun.models.dflash_loader import load_dflash
from batchrun.models.loader import load_qwen3
from batchrun.models.qwen3 import Qwen3ForCausalLM
from batchrun.parallel.group import TensorParallel
from batchrun.speculative.acceptance import RoundTrace, accepted_lengths
from batchrun.speculative.draft_oracle import DraftOracle
from batchrun.speculative.verify_width import WidthPolicy, step_width

ROPE_HEADROOM = 1024  # verify/draft rows may run past the context end; their tokens are cut


@dataclass
class Launched:
    """A step on the GPU whose tokens the host has not read yet."""

    batch: list[Scheduled]
    samples: list[int]  # rows sampled per item
    epochs: list[int]  # each request's epoch at launch: a later one drops the result
    host: torch.Tensor  # sampled tokens, accepted counts (and drafts when traced), on their way
    ready: torch.cuda.Event | None
    num_drafts: int  # drafts per decoding request copied back (0: not traced)
    kind: str  # prefill, mixed or decode
    width: int  # the step's verify width
    rows: int  # the rows its target forward computed
    uniform: bool  # every request decoded
    seconds: float | None  # off a GPU the launch ran the step: its time
    logprobs: StepLogprobs | None = None  # when the job asks for them


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: PreTrainedTokenizerBase | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        """Loads the models (and the target's tokenizer, unless it is given); with tp, this
        tensor-parallel rank's share of the target (on the group's device) and the whole draft."""
        device = tp.device if tp is not None else resolve_device(config.device)
        if device.type == "cuda":  # a dropped engine's KV pools, freed before these are sized
            collect_everything()
        clock = StartupClock(device)
        target_dir = Path(config.target)
        model, model_config = load_qwen3(target_dir, config.dtype, device, ROPE_HEADROOM, tp)
        clock.lap("load_target")
        max_positions = model.shape.max_position_embeddings + ROPE_HEADROOM
        draft = None
        if config.draft:
            draft = load_dflash(Path(config.draft), model, device, max_positions)
            clock.lap("load_draft")
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(target_dir)
        eos = eos_token_ids(target_dir, model_config, tokenizer)
        clock.lap("load_tokenizer")
        self._setup(config, model, draft, tokenizer, eos, config.num_pages, tp, clock)

    @classmethod
    def from_models(
        cls,
        config: EngineConfig,
        model: Qwen3ForCausalLM,
        draft: DFlashDraft | None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        eos: set[int] | None = None,
        num_pages: int | None = None,
        tp: TensorParallel | None = None,
    ) -> Engine:
        """An engine over models already on their device (`batchrun bench --shape`)."""
        engine = cls.__new__(cls)
        clock = StartupClock(model.lm_head.weight.device)
        engine._setup(config, model, draft, tokenizer, eos or set(), num_pages, tp, clock)
        return engine

    def _setup(
        self,
        config: EngineConfig,
        model: Qwen3ForCausalLM,
        draft: DFlashDraft | None,
        tokenizer: PreTrainedTokenizerBase | None,
        eos: set[int],
        num_pages: int | None,
        tp: TensorParallel | None,
        clock: StartupClock,
    ) -> None:
        """Under tensor parallelism every rank runs this engine in lockstep: the same requests,
        the same schedule. What memory or timings decide here, rank 0's or the least is taken
        on every rank."""
        self.config, self.tp = config, tp
        self.model, self.draft = model, draft
        self.device = model.lm_head.weight.device
        self._tokenizer = tokenizer
        shape = model.shape
        self.vocab_size = shape.vocab_size
        self.block_size = draft.block_size if draft else None
        width = self.block_size or 1
        check_batch_budget(config.max_batched_tokens, width)  # before the KV pools are allocated
        window = draft.attention.window if draft else None
        element = model.lm_head.weight.element_size()
        num_pages = num_pages or job_kv_pages(config, shape, draft, element, self.device)
        if tp is not None:
            num_pages = tp.minimum(num_pages)
        self.max_model_len = usable_context(config, shape, num_pages, width, self.device)
        self.num_pages = num_pages  # each job's page pool (_start_job) holds them
        # A cached prefix has no logits: prompt log-probabilities need every prompt computed.
        self.prefix_caching = config.prefix_caching and not config.prompt_logprobs
        workload = Workload(
            num_heads=max(shape.num_heads, draft.shape.num_heads if draft else 0),
            num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
            dtype=str(model.lm_head.weight.dtype).removeprefix("torch."),
            page_size=config.page_size, batch=config.max_batch_size,
            block_size=width, num_layers=shape.num_layers,
            draft_layers=draft.shape.num_layers if draft else 0,
            context=min(MEASURED_CONTEXT, self.max_model_len - width),
        )  # fmt: skip
        backend, ops, self.backend_ms = attention_backend(
            config.attention_backend, self.device, workload
        )
        chosen = tp.of_first(backend.name) if tp is not None else backend.name
        if chosen != backend.name:  # `auto` timed its candidates on each rank: rank 0's wins
            backend, ops, _ = attention_backend(chosen, self.device, workload)
        # Sliding draft layers plan their own metadata: a second backend of the same kind.
        window_backend = None
        if window:
            window_backend = attention_backend(backend.name, self.device, workload)[0]
        use_ops(model, ops)
        if draft is not None:
            use_ops(draft, ops)
        clock.lap("size_memory_choose_backend")
        self.runner = ModelRunner(
            model, draft, backend, num_pages, config.page_size, config.max_batch_size,
            config.max_batched_tokens, self.max_model_len, self.device, window_backend,
        )  # fmt: skip
        self.widths = verify_widths(config.verify_width, self.block_size)
        self.pinned_width: int | None = None  # set by `batchrun bench` to time one width
        # Benchmark only (`batchrun bench --jobs`): rewrites each step's drafts; never set by run.
        self.draft_oracle: DraftOracle | None = None
        clock.lap("allocate_kv")
        if config.cuda_graphs and backend.graphable and self.device.type == "cuda":
            self.runner.capture_graphs(config.max_batch_size, self.widths)
            clock.lap("capture_graphs")
        # Prompt tokens a request computes even when a cached prefix or a sibling sample's pages
        # hold them: all of them for their log-probabilities; for a sliding draft, the W - 1
        # positions its first block reads back.
        self._recompute_tail = max(window - 1, 1) if window else 1
        if config.prompt_logprobs:
            self._recompute_tail = self.max_model_len
        self.built_batch_size = config.max_batch_size  # graphs and slots exist up to it
        self._start_job()
        self.stopper = Stopper(tokenizer, eos, self.max_model_len)
        self.timer = StepTimer(self.device)
        self.round_trace: list[RoundTrace] | None = None  # set to a list to record rounds
        self._backend_name = backend.name
        self._dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
        freeze_heap()  # what exists now lives as long as the job: no collection need walk it
        clock.lap("freeze_heap")
        self.startup_seconds = clock.seconds

    def new_job(self, max_batch_size: int | None = None) -> None:
        """Start as a fresh engine: no cached prefixes, no width measurements, no counts. The
        models, KV pools and CUDA graphs stay (`batchrun bench --jobs` runs jobs on one), and
        the job may run fewer requests at a time than the engine was built for."""
        if self.num_unfinished:
            raise JobError("an engine starts a new job only when the last one has finished")
        built = self.built_batch_size
        self.config = replace(self.config, max_batch_size=min(max_batch_size or built, built))
        self._start_job()

    def _start_job(self) -> None:
        config = self.config
        self.pool = PagePool(self.num_pages, config.page_size, self.prefix_caching)
        self.scheduler = Scheduler(
            self.pool,
            config.max_batch_size,
            config.max_batched_tokens,
            decode_width=self.block_size or 1,
            min_width=self.widths[0],
            recompute_tail=self._recompute_tail,
        )
        self.width_policy = (
            WidthPolicy(self.block_size, self.widths)
            if self.block_size and len(self.widths) > 1
            else None
        )
        self.width_steps: Counter[int] = Counter()  # verify width -> steps that decoded at it
        self.step_kinds: Counter[str] = Counter()  # prefill, mixed, decode -> steps
        self.step_seconds: dict[str, float] = {}  # the same kinds -> their pipeline periods
        self.decode_forwards = 0  # decode/verify rounds of a request, over every step
        self.decode_tokens = 0  # the tokens those rounds committed
        self._launched: Launched | None = None
        self._last_done: float | None = None  # when the host last read a step's results
        self._last_width = 0  # the width of the step read back before

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            raise JobError("this engine was built without a tokenizer")
        return self._tokenizer

    def info(self) -> dict[str, Any]:
        return {
            "target": str(self.config.target),
            "draft": str(self.config.draft) if self.config.draft else None,
            "dtype": self._dtype,
            "device": str(self.device),
            "tensor_parallel": self.tp.world_size if self.tp is not None else 1,
            "attention_backend": self._backend_name,
            "attention_backend_ms": self.backend_ms,  # `auto`'s measurement, when it chose
            "verify_width_steps": dict(sorted(self.width_steps.items())) or None,
            # What speculation buys: tokens a decoding request commits per target forward.
            "tokens_per_target_forward": (
                self.decode_tokens / self.decode_forwards if self.decode_forwards else None
            ),
            "steps": dict(self.step_kinds),
            # Where the job's time went: each step's period (the time between its results and
            # the previous step's), summed by kind.
            "step_seconds": {k: round(v, 4) for k, v in self.step_seconds.items()},
            "cuda_graphs": bool(self.runner.target_graphs),
            "prefix_cache_hit_rate": self.pool.hit_rate,
            "startup_seconds": self.startup_seconds,
        }

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def add(self, request: Request) -> None:
        """Queue the request's params.n samples (`sample_requests`): each finishes on its own."""
        for req in sample_requests(request):
            if self.block_size and req.spec_hist is None:
                req.spec_hist = [0] * self.block_size
                req.spec_capped = [0] * self.block_size
            if req.logprobs is None:
                req.logprobs = asked_logprobs(self.config.logprobs, self.config.prompt_logprobs)
            self.scheduler.add(req)

    def abort_all(self) -> None:
        """Drop every unfinished request and free its pages (benchmarks between points)."""
        if self._launched is not None and self._launched.ready is not None:
            self._launched.ready.synchronize()
        self._launched = self._last_done = None
        self._last_width = 0
        for req in list(self.scheduler.running):
            self.scheduler.finish(req)
        for req in self.scheduler.waiting:  # preempted ones may hold no pages; fresh ones none
            self.pool.release(req.pages)
        self.scheduler.waiting.clear()

    # -- one step -----------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Launch the next step, then read back the one before it; returns the requests that
        one finished."""
        width = self._width()
        batch = self.scheduler.schedule(width)
        decoding = sum(it.decoding for it in batch)
        kind = "decode" if decoding == len(batch) else "mixed" if decoding else "prefill"
        if batch:
            self.step_kinds[kind] += 1
        if self.block_size and decoding:
            self.width_steps[width] += 1
        launched = self._launch(batch, width, kind) if batch else None
        finished = self._read_back(self._launched) if self._launched is not None else []
        self._launched = launched
        return finished

    def _width(self) -> int:
        """The next step's verify width: pinned, the policy's choice, or the only one."""
        if self.pinned_width is not None or self.width_policy is None:
            return self.pinned_width or self.widths[-1]
        running = len(self.scheduler.running)
        width = step_width(
            self.width_policy,
            bucket=ladder_bucket(running, self.config.max_batch_size),
            running=running,
            prefill_pending=self.scheduler.prefill_pending,
            max_batched_tokens=self.config.max_batched_tokens,
        )
        if self.tp is not None:  # chosen from this rank's step times: rank 0's wins
            width = self.tp.first_int(width)
        return width

    @torch.inference_mode()
    def _launch(self, batch: list[Scheduled], width: int, kind: str) -> Launched:
        runner = self.runner
        started = time.perf_counter()
        samples = [rows_sampled(it) for it in batch]
        all_decoding = all(it.decoding for it in batch)
        pad_to = runner.graph_size(len(batch), width) if all_decoding else None
        runner.state.admit(self.scheduler.admitted)  # before planning: it resends their pages
        if self.draft_oracle is not None:
            self.draft_oracle.admit(self.scheduler.admitted)
        plan = plan_step(batch, samples, width, self.pool.page_size, runner.state.num_slots, pad_to)
        prompt = prompt_rows(batch) if self.config.prompt_logprobs else None
        for it in batch:  # the host's view moves on; decode rows commit when read back
            req = it.req
            if it.decoding:
                req.in_flight += it.num_new
            else:
                start, req.num_cached = req.num_cached, req.num_cached + it.num_new
                prefix = req.token_slice(0, req.num_cached)
                self.pool.register(req.pages, prefix, start, req.num_cached)
        self.timer.mark()
        args = runner.load(plan)
        num_dec = plan.num_decoding
        drafts = None
        if self.draft is not None and num_dec and width > 1:
            drafts = runner.draft_step(args, plan)
            if self.draft_oracle is not None:  # in place: a graph's target reads them there
                self.draft_oracle.rewrite(drafts, args.slot[:num_dec], runner.state.out_len)
            drafts = drafts[:, : width - 1]
        elif self.draft is not None and num_dec and runner.context_pending:
            runner.write_pending_context(args, plan)
        self.timer.mark()
        out = runner.target_step(args, plan, drafts)
        tokens = self._sample(out, batch, samples)
        scores = None
        if self.config.logprobs is not None or (prompt is not None and prompt.rows):
            scores = self._score(out, batch, samples, tokens[: sum(samples)], prompt)
        if drafts is not None:
            accepted = accepted_lengths(drafts, tokens[: num_dec * width].view(num_dec, width))
        else:
            accepted = tokens.new_zeros(num_dec)
        live = plan.num_live
        runner.state.commit(
            args.slot[:live], args.q_len[:live], args.sampled[:live], tokens, accepted,
            num_dec, width,
        )  # fmt: skip
        self.timer.mark()
        # The step's one device-to-host copy: sampled tokens, accepted counts (drafts if traced).
        parts = [tokens[: sum(samples)], accepted]
        traced = self.round_trace is not None and drafts is not None
        if traced and drafts is not None:
            parts.append(drafts.reshape(-1))
        host, ready = _to_host(torch.cat(parts))
        return Launched(
            batch, samples, [it.req.epoch for it in batch], host, ready,
            num_drafts=width - 1 if traced else 0, kind=kind, width=width, rows=plan.num_rows,
            uniform=plan.uniform,
            seconds=None if ready is not None else time.perf_counter() - started, logprobs=scores,
        )  # fmt: skip

    def _sample(
        self, out: TargetOutput, batch: list[Scheduled], samples: list[int]
    ) -> torch.Tensor:
        """The token of every sampled row, on the device: argmax when every row is greedy."""
        params = [it.req.params for it, k in zip(batch, samples, strict=True) if k]
        if all(p.temperature == 0 for p in params):
            return self.model.argmax(out.logits)
        rows = self.runner.state.sampling(out.row_slot, out.row_step)
        logits = self.model.full_logits(out.logits)
        return sample(logits, rows, any_filtered=_any_filtered(batch, samples))

    def _score(
        self,
        out: TargetOutput,
        batch: list[Scheduled],
        samples: list[int],
        tokens: torch.Tensor,
        prompt: PromptRows | None,
    ) -> StepLogprobs:
        """The log-probabilities the job asks for, of the sampled rows (padding left out) and
        of the prompt rows, on their way to the host."""
        n = tokens.shape[0]
        rows = self.runner.state.sampling(out.row_slot[:n], out.row_step[:n])
        model = self.model
        return score_step(
            model.full_logits(out.logits), out.hidden, rows, tokens, self.config.logprobs,
            _any_filtered(batch, samples), prompt, lambda h: model.full_logits(model.logits(h)),
        )  # fmt: skip

    def _read_back(self, launched: Launched) -> list[Request]:
        """Commit a launched step's tokens on the host: stop checks, outputs, finished ones."""
        if launched.ready is not None:
            launched.ready.synchronize()
        values = launched.host.tolist()
        num_sampled = sum(launched.samples)
        num_dec = sum(it.decoding for it in launched.batch)
        post_all, values = values[:num_sampled], values[num_sampled:]
        scores = ReadLogprobs(launched.logprobs) if launched.logprobs is not None else None
        accepted, drafts = values[:num_dec], values[num_dec:]
        self._learn(launched, accepted)
        d = launched.num_drafts
        finished, pos, dec = [], 0, 0
        items = zip(launched.batch, launched.samples, launched.epochs, strict=True)
        for i, (it, k, epoch) in enumerate(items):
            req = it.req
            post = post_all[pos : pos + k]
            pos += k
            if it.decoding:
                dec += 1
            if req.epoch != epoch:  # finished or preempted since: this result is dropped
                continue
            before = len(req.output_ids)
            if it.decoding:
                req.in_flight -= it.num_new
                drafted = drafts[(dec - 1) * d : dec * d]
                self._commit_round(req, post, accepted[dec - 1], drafted, launched.width)
            elif post:  # the first token, sampled from the prompt's last row
                self.stopper.commit(req, post)
            if scores is not None:  # the rows of the tokens kept (stop rules cut the rest)
                scores.commit(req, i, pos - k, len(req.output_ids) - before)
            if req.finish_reason:
                self.scheduler.finish(req)
                finished.append(req)
            else:  # release KV past the committed tokens and the rows still in flight
                self.pool.shrink(req.pages, req.num_cached + req.in_flight)
                req.pages_on_device = min(req.pages_on_device, len(req.pages))
        return finished

    def _learn(self, launched: Launched, accepted: list[int]) -> None:
        """Feed the verify-width policy: the rounds' acceptance, and the step's cost when every
        request decoded (a step with prefill chunks says little about a width's cost). On a GPU
        a step costs the time between its results and the previous step's: the period of the
        overlapped pipeline, whichever of host and GPU bounds it."""
        done, last = time.perf_counter(), self._last_done
        self._last_done = done
        switched, self._last_width = launched.width != self._last_width, launched.width
        seconds = launched.seconds if launched.seconds is not None else done - (last or done)
        kind = launched.kind
        self.step_seconds[kind] = self.step_seconds.get(kind, 0.0) + seconds
        policy = self.width_policy
        if policy is None:
            return
        for a in accepted if launched.width > 1 else ():
            policy.record_round(launched.width, a)
        if seconds > 0 and not switched:
            policy.record_rows(launched.rows, seconds * 1e3)
        if launched.uniform and seconds > 0 and not switched:
            bucket = ladder_bucket(len(launched.batch), self.config.max_batch_size)
            policy.record_cost(launched.width, bucket, seconds * 1e3)

    def _commit_round(
        self, req: Request, post: list[int], acc: int, drafts: list[int], width: int
    ) -> None:
        """Commits post[0 .. acc] (acc accepted drafts plus the target's own next token)."""
        p, anchor = req.num_cached, req.output_ids[-1]
        kept = self.stopper.commit(req, post[: acc + 1])
        req.num_cached = p + acc + 1  # anchor .. d_acc now hold target KV; the bonus is next
        self.decode_forwards += 1
        self.decode_tokens += kept
        if req.spec_hist is not None and req.spec_capped is not None:
            if width > 1:  # a speculation round (width 1 is plain decoding: it drafts nothing)
                req.spec_rounds += 1
                req.spec_hist[kept - 1] += 1
                if acc == width - 1 and kept == width:  # every draft it verified was accepted
                    req.spec_capped[kept - 1] += 1
            if self.round_trace is not None:
                committed = req.output_ids[len(req.output_ids) - kept :]
                self.round_trace.append(RoundTrace(req.row_index, p, anchor, drafts, committed))


def _any_filtered(batch: list[Scheduled], samples: list[int]) -> bool:
    """Some sampled row has top-k or top-p (known on the host: no search on the device)."""
    params = (it.req.params for it, k in zip(batch, samples, strict=True) if k)
    return any(p.top_k or p.top_p < 1 for p in params if p.temperature > 0)


def _to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """An asynchronous copy into pinned memory on a GPU, and the event that marks it (and
    every copy issued before it) done."""
    host = to_host(values)
    if values.device.type != "cuda":
        return host, None
    ready = torch.cuda.Event()
    ready.record()
    return host, ready

"""The engine: load the models, then step the continuous batch until every request finishes.

A step, as `step` reads: the scheduler returns it as one `ScheduledStep` (core/step.py: the
requests and their rows, prefill chunks, decode rows, verify blocks); the speculator proposes
drafts for the decoding ones (none at width 1: plain decoding is a verify round that drafts
nothing, so both share one commit rule); the target runs over every row; its features go to the
speculator; the sampled tokens, the drafts they accept and the commit into the per-slot device
state are computed on the device, and one small copy per step brings back what was committed,
which the scheduler applies in one place (`Scheduler.update_from_output`: stop rules, token
progress, statistics).

Steps overlap: step N+1 is scheduled and launched before the host reads step N's tokens (its
inputs come from the device state, which step N updates on the device), so the host's work of
committing, stop checks and scheduling runs while the GPU computes. A request that step N
finishes or a preemption drops runs once more in step N+1; that result is dropped.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from batchrun.device import resolve_device
from batchrun.engine.compiling import Compiling
from batchrun.engine.config import EngineConfig, check_batch_budget, verify_widths
from batchrun.engine.core.page_pool import PagePool
from batchrun.engine.core.requests import Request, sample_requests
from batchrun.engine.core.scheduler import Recorded, Scheduler
from batchrun.engine.core.step import ScheduledStep, StepOutput
from batchrun.engine.core.stopping import Stopper
from batchrun.engine.heap import collect_everything, freeze_heap
from batchrun.engine.host_memory import keep_freed_memory
from batchrun.engine.in_flight import Forward, Launched, copy_to_host
from batchrun.engine.instruments import Instruments, StepTimer
from batchrun.engine.model_runner import ModelRunner, RunnerSizes
from batchrun.engine.startup import (
    Models,
    StartupClock,
    choose_backend,
    load_models,
    size_memory,
)
from batchrun.engine.step_inputs import plan_step, rows_sampled
from batchrun.errors import JobError
from batchrun.layers.moe import fused_kernel
from batchrun.parallel.group import TensorParallel
from batchrun.sampling.grammar import Grammars
from batchrun.sampling.grammar_masks import StepMasks, build_masks
from batchrun.sampling.logprobs import ReadLogprobs, prompt_rows
from batchrun.sampling.row_grammar import RowGrammar
from batchrun.sampling.step_sampling import (
    SampledRows,
    processed_logits,
    sample_tokens,
    score_tokens,
)
from batchrun.spec_decode.dflash.speculator import DraftBackends, make_speculator


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: PreTrainedTokenizerBase | None = None,
        tp: TensorParallel | None = None,
        models: Models | None = None,
        num_pages: int | None = None,
    ) -> None:
        """Loads the models (unless given) and builds the engine in named stages
        (`startup_seconds`). With tp, this tensor-parallel rank's share of the target (on the
        group's device) and the whole draft; every rank runs the engine in lockstep (the same
        requests, the same schedule), so what memory or timings decide is agreed across ranks.
        num_pages: the KV pool's size (default: what memory holds)."""
        device = tp.device if tp is not None else resolve_device(config.device)
        if device.type == "cuda":  # a dropped engine's KV pools, freed before these are sized
            collect_everything()
        else:  # a CPU step's temporaries reused, not faulted in afresh each step
            keep_freed_memory()
        clock = StartupClock(device)
        models = models or load_models(config, tokenizer, device, tp, clock)
        self.config, self.tp, self.model = config, tp, models.target
        self.device = self.model.lm_head.weight.device
        self._tokenizer = models.tokenizer
        self.vocab_size = self.model.shape.vocab_size
        draft = models.draft
        block = draft.block_size if draft is not None else 1
        check_batch_budget(config.max_batched_tokens, block)  # before the KV pools are allocated
        self.num_pages, self.max_model_len = size_memory(config, models, block, tp, num_pages)
        clock.lap("size_memory")
        choice = choose_backend(config, models, block, self.max_model_len, tp)
        backend, self.backend_ms = choice.backend, choice.measured_ms
        clock.lap("choose_backend")
        sizes = RunnerSizes.of(config, self.num_pages, self.max_model_len, block)
        speculate = partial(
            make_speculator,
            draft=draft,
            backends=DraftBackends(backend, choice.window_backend),
            widths=verify_widths(config.verify_width, block if draft is not None else None),
            max_batch_size=config.max_batch_size,
            tp=tp,
        )
        self.runner = ModelRunner(
            self.model,
            backend,
            sizes,
            self.device,
            kv_cache_dtype=config.kv_cache_dtype,
            speculate=speculate,
        )
        self.speculator = self.runner.speculator
        clock.lap("build_runner")
        # A MoE target's experts are graphed only fused (the reference reads routing on the host).
        graphable = backend.graphable and (not self.model.shape.num_experts or fused_kernel())
        if config.cuda_graphs and graphable and self.device.type == "cuda":
            self.capture_graphs()
            clock.lap("capture_graphs")
        # A cached prefix has no logits: prompt log-probabilities need every prompt computed.
        self.prefix_caching = config.prefix_caching and config.prompt_logprobs is None
        self.built_batch_size = config.max_batch_size  # graphs and slots exist up to it
        self.stopper = Stopper(models.tokenizer, set(models.eos), self.max_model_len)
        # min_tokens masks the end-of-sequence ids.
        self.runner.state.sampling.controls.eos_ids = frozenset(models.eos)
        self.instruments = Instruments(StepTimer(self.device))
        self._grammars: Grammars | None = None
        self._grammars_made = threading.Lock()  # the prefetch thread may ask for them first
        self._start_job()
        freeze_heap()  # what exists now lives as long as the job: no collection need walk it
        clock.lap("freeze_heap")
        self.startup_seconds = clock.seconds

    def capture_graphs(self) -> None:
        """The steady-state step's CUDA graphs, the target's and the speculator's (off a GPU
        they are emulated: the tests run them so)."""
        self.runner.capture_graphs(self.config.max_batch_size, self.speculator.widths)

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
        config, speculator = self.config, self.speculator
        self.pool = PagePool(self.num_pages, config.page_size, self.prefix_caching)
        # Prompt tokens a request computes even when a cached prefix or a sibling sample's
        # pages hold them: all of them for their log-probabilities.
        scored = config.prompt_logprobs is not None
        tail = self.max_model_len if scored else speculator.recompute_tail
        self.scheduler = Scheduler(
            self.pool,
            config.max_batch_size,
            config.max_batched_tokens,
            decode_width=speculator.block_size,
            min_width=speculator.widths[0],
            recompute_tail=tail,
            recorded=Recorded(self.block_size, config.logprobs, config.prompt_logprobs),
        )
        speculator.start_job(config.max_batch_size, config.max_batched_tokens)
        self.compiling = Compiling(self.tp)  # constrained requests waiting for their grammar
        self.step_kinds: Counter[str] = Counter()  # prefill, mixed, decode -> steps
        self.step_seconds: dict[str, float] = {}  # the same kinds -> their pipeline periods
        self._launched: Launched | None = None
        self._last_done: float | None = None  # when the host last read a step's results

    @property
    def block_size(self) -> int | None:
        """The draft's block size (None: no draft)."""
        return self.speculator.block_size if self.speculator.drafting else None

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            raise JobError("this engine was built without a tokenizer")
        return self._tokenizer

    def info(self) -> dict[str, Any]:
        config = self.config
        return {
            "target": str(config.target),
            "draft": str(config.draft) if config.draft else None,
            "dtype": str(self.model.lm_head.weight.dtype).removeprefix("torch."),
            "device": str(self.device),
            "tensor_parallel": self.tp.world_size if self.tp is not None else 1,
            "attention_backend": self.runner.backend.name,
            "kv_cache_dtype": str(self.runner.kv_caches[0][0].dtype).removeprefix("torch."),
            "attention_backend_ms": self.backend_ms,  # `auto`'s measurement, when it chose
            # What speculation buys: tokens a decoding request commits per target forward.
            "tokens_per_target_forward": self.scheduler.tokens_per_round,
            "steps": dict(self.step_kinds),
            # Where the job's time went: each step's period (the time between its results and
            # the previous step's), summed by kind.
            "step_seconds": {k: round(v, 4) for k, v in self.step_seconds.items()},
            "cuda_graphs": bool(self.runner.target_graphs),
            "prefix_cache_hit_rate": self.pool.hit_rate,
            "prompt_tokens_computed": self.scheduler.prompt_tokens_computed,
            "startup_seconds": self.startup_seconds,
        } | self.speculator.info()

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished + len(self.compiling)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def add(self, request: Request) -> None:
        """Queue the request's params.n samples (`sample_requests`): each finishes on its own.
        A constrained one waits for its grammar's compile (engine/compiling.py) apart."""
        for req in sample_requests(request):
            if req.params.constraint is not None and req.output.grammar is None:
                self.compiling.add(req, self.grammars.submit(req.params.constraint))
            else:
                self.scheduler.add(req)

    @property
    def grammars(self) -> Grammars:
        """The structured outputs' compiler, made for the first constrained request. Only rank
        0 holds compiles to the time budget (engine/compiling.py)."""
        with self._grammars_made:
            if self._grammars is None:
                budget = self.config.compile_budget
                if self.tp is not None and self.tp.rank != 0:
                    budget = replace(budget, seconds=None)
                eos = self.stopper.eos_ids
                self._grammars = Grammars(self.tokenizer, self.vocab_size, eos, budget)
            return self._grammars

    def _admit_compiled(self) -> list[Request]:
        """Constrained requests whose compile is over join the queue with their grammar (the
        answer's after a think block when a reasoning parser splits the output); returns those
        finished as errors."""
        if not self.compiling:
            return []
        ready, failed = self.compiling.settle(self.grammars)
        for req, job in ready:
            matcher = self.grammars.matcher_of(job)
            think = self.stopper.think if req.params.reasoning else None
            self.scheduler.add(req, grammar=RowGrammar.of(matcher, think, req.prompt_ids))
        return failed

    def abort_all(self) -> None:
        """Drop every unfinished request and free its pages (benchmarks between points)."""
        if self._launched is not None and self._launched.ready is not None:
            self._launched.ready.synchronize()
        self._launched = self._last_done = None
        self.speculator.aborted()
        self.scheduler.abort_all()
        self.compiling.clear()

    # -- one step -----------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Launch the next step, then read back the one before it; returns the requests that
        one finished. A step with constrained rows reads the one before it back between its
        forward and its sampling: its masks start from the tokens that step commits."""
        scheduler = self.scheduler
        failed = self._admit_compiled()
        width = self.speculator.next_width(len(scheduler.running), scheduler.prefill_pending)
        scheduled = scheduler.schedule(width)
        forward = self._forward(scheduled) if scheduled.items else None
        previous, self._launched = self._launched, None
        finished, masks = [], None
        if forward is not None and forward.constrained:
            finished = self._read_back(previous) if previous is not None else []
            previous = None
            masks = build_masks(self.grammars, forward.constrained_rows(), self.device)
        launched = self._sample(forward, masks) if forward is not None else None
        if previous is not None:
            finished = self._read_back(previous)
        elif forward is None and self.compiling:  # nothing runs but compiles: wait a bit
            self.compiling.wait(self.grammars)
        self._launched = launched
        return failed + finished

    @torch.inference_mode()
    def _forward(self, scheduled: ScheduledStep) -> Forward:
        """Launch the step's drafts and target forward."""
        runner, speculator = self.runner, self.speculator
        batch, width = scheduled.items, scheduled.width
        started = time.perf_counter()
        params = [it.req.params for it in batch]
        sampled = SampledRows(params, [rows_sampled(it) for it in batch])
        decoding = all(it.decoding for it in batch)
        pad_to = runner.graph_size(len(batch), width) if decoding else None
        admitted = scheduled.admitted
        if admitted:  # new slots' state, sent once
            speculator.admit(admitted, runner.state.admit(admitted))
        plan = plan_step(
            batch, sampled.counts, width, self.pool.page_size, runner.state.num_slots, pad_to
        )
        self.step_kinds[plan.kind] += 1
        prompt_k = self.config.prompt_logprobs
        prompt = prompt_rows(batch, prompt_k) if prompt_k is not None else None
        self.scheduler.launched(scheduled)
        epochs = [it.req.state.epoch for it in batch]
        self.instruments.timer.mark()
        args = runner.load(plan)
        drafts = speculator.propose(plan, args.slot)
        constrained = any(it.req.output.grammar is not None for it in batch)
        # A constrained step's masks follow the drafts: they start for the host now.
        drafts_host = copy_to_host(drafts) if constrained and drafts is not None else None
        self.instruments.timer.mark()
        out = runner.target_step(args, plan, drafts)
        speculator.observe(out.features)
        return Forward(
            batch=batch,
            plan=plan,
            sampled=sampled,
            epochs=epochs,
            args=args,
            out=out,
            drafts=drafts,
            constrained=constrained,
            drafts_host=drafts_host,
            prompt=prompt,
            started=started,
        )

    @torch.inference_mode()
    def _sample(self, forward: Forward, masks: StepMasks | None) -> Launched:
        """Launch the step's sampling, acceptance and commit, and the copy of its results."""
        runner, speculator = self.runner, self.speculator
        plan, args, out, drafts = forward.plan, forward.args, forward.out, forward.drafts
        sampled, prompt, width = forward.sampled, forward.prompt, plan.width
        tables, d = runner.state.sampling, plan.num_decoding
        logits = processed_logits(self.model, tables, out, sampled, drafts, d, masks)
        tokens = sample_tokens(self.model, tables, out, sampled, logits)
        scores = None
        if self.config.logprobs is not None or (prompt is not None and prompt.rows):
            k = self.config.logprobs
            scores = score_tokens(self.model, tables, out, sampled, tokens, k, prompt, logits)
        accepted = speculator.accept(drafts, tokens, plan)
        live = plan.num_live
        slots = args.slot[:live]
        q_lens, counts = args.q_len[:live], args.sampled[:live]
        runner.state.commit(slots, q_lens, counts, tokens, accepted, d, width)
        speculator.commit(slots[:d], accepted, plan)
        self.instruments.timer.mark()
        # The step's one device-to-host copy: sampled tokens, accepted counts (drafts if traced).
        parts = [tokens[: sampled.total], accepted]
        traced = self.instruments.rounds is not None and drafts is not None
        if traced and drafts is not None:
            parts.append(drafts.reshape(-1))
        host, ready = copy_to_host(torch.cat(parts))
        seconds = None if ready is not None else time.perf_counter() - forward.started
        drafted = width - 1 if traced else 0
        return Launched(
            batch=forward.batch,
            plan=plan,
            sampled=sampled,
            epochs=forward.epochs,
            host=host,
            ready=ready,
            num_drafts=drafted,
            seconds=seconds,
            logprobs=scores,
        )

    def _read_back(self, launched: Launched) -> list[Request]:
        """Read a launched step's results back and have the scheduler apply them; returns the
        requests it finished."""
        if launched.ready is not None:
            launched.ready.synchronize()
        values = launched.host.tolist()
        num_sampled = launched.sampled.total
        num_dec = launched.plan.num_decoding
        tokens, values = values[:num_sampled], values[num_sampled:]
        accepted, drafts = values[:num_dec], values[num_dec:]
        self._learn(launched, accepted)
        output = StepOutput(
            items=launched.batch,
            epochs=launched.epochs,
            counts=launched.sampled.counts,
            tokens=tokens,
            accepted=accepted,
            drafts=drafts,
            num_drafts=launched.num_drafts,
            width=launched.plan.width,
        )
        scores = ReadLogprobs(launched.logprobs) if launched.logprobs is not None else None
        return self.scheduler.update_from_output(
            output, stopper=self.stopper, scores=scores, rounds=self.instruments.rounds
        )

    def _learn(self, launched: Launched, accepted: list[int]) -> None:
        """A step's time, by kind, and what the speculator learns from it. On a GPU a step
        costs the time between its results and the previous step's: the period of the
        overlapped pipeline, whichever of host and GPU bounds it."""
        done, last = time.perf_counter(), self._last_done
        self._last_done = done
        seconds = launched.seconds if launched.seconds is not None else done - (last or done)
        kind = launched.plan.kind
        self.step_seconds[kind] = self.step_seconds.get(kind, 0.0) + seconds
        self.speculator.learn(launched.plan, accepted, seconds)

"""The engine: load the models, then step the continuous batch until every request finishes.

A step, as `step` reads: the scheduler decides it as one `ScheduledStep` (core/step.py: a
snapshot of each request's part, prefill chunks, decode rows, verify blocks) and marks it
launched; the worker (worker.py) launches it on the device: the speculator's drafts for the
decoding requests (each verifying at its own width; none when every one is at width 1: plain
decoding is a verify round that drafts nothing, so both share one commit rule), the target over
every row, the sampled tokens, the drafts they accept and the commit into the per-slot device
state; one small copy per step brings back what was
committed, which the scheduler applies in one place (`Scheduler.update_from_output`: stop rules,
token progress, statistics).

Steps overlap: step N+1 is scheduled and launched before the host reads step N's tokens (its
inputs come from the device state, which step N updates on the device), so the host's work of
committing, stop checks and scheduling runs while the GPU computes. A request that step N
finishes or a preemption drops runs once more in step N+1; that result is dropped.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from transformers import PreTrainedTokenizerBase

from batchrun.device import resolve_device
from batchrun.engine.batch_choice import BatchChoice, RowTokens
from batchrun.engine.compiling import Compiling, GrammarsOnce
from batchrun.engine.config import EngineConfig, check_batch_budget
from batchrun.engine.core.page_pool import PagePool
from batchrun.engine.core.requests import Request, sample_requests
from batchrun.engine.core.scheduler import Recorded, Scheduler
from batchrun.engine.core.state_snapshots import SnapshotPool
from batchrun.engine.core.stopping import Stopper
from batchrun.engine.heap import collect_everything, freeze_heap
from batchrun.engine.host_memory import keep_freed_memory
from batchrun.engine.in_flight import Launched
from batchrun.engine.model_runner import RunnerSizes
from batchrun.engine.startup import (
    Models,
    StartupClock,
    choose_backend,
    choose_engine_batch,
    load_models,
    size_memory,
)
from batchrun.engine.worker import Worker
from batchrun.errors import JobError
from batchrun.layers.moe import fused_kernel
from batchrun.parallel.group import TensorParallel
from batchrun.sampling.grammar import Grammars
from batchrun.spec_decode.method import DraftBackends
from batchrun.spec_decode.registry import make_speculator
from batchrun.spec_decode.verify_widths import verify_widths


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: PreTrainedTokenizerBase | None = None,
        tp: TensorParallel | None = None,
        models: Models | None = None,
        num_pages: int | None = None,
        rows: RowTokens | None = None,
        batch: BatchChoice | None = None,
    ) -> None:
        """Loads the models (unless given) and builds the engine in named stages
        (`startup_seconds`). With tp, this tensor-parallel rank's share of the target (on the
        group's device) and the whole draft; every rank runs the engine in lockstep (the same
        requests, the same schedule), so what memory or timings decide is agreed across ranks.
        num_pages: the KV pool's size (default: what memory holds). rows: the job's rows'
        length, which an unset max_batch_size is chosen for (None: the model's max positions);
        batch: the runner's choice, made by preflight before the weights loaded."""
        device = tp.device if tp is not None else resolve_device(config.device)
        if device.type == "cuda":  # a dropped engine's KV pools, freed before these are sized
            collect_everything()
        else:  # a CPU step's temporaries reused, not faulted in afresh each step
            keep_freed_memory()
        clock = StartupClock(device)
        models = models or load_models(config, tokenizer, device, tp, clock)
        self.batch = choose_engine_batch(config, models, rows, tp, batch)
        config = replace(config, max_batch_size=self.batch.size)
        clock.lap("choose_batch")
        self.config, self.tp, self.model = config, tp, models.target
        self.device = self.model.lm_head.weight.device
        self._tokenizer = models.tokenizer
        self.vocab_size = self.model.shape.vocab_size
        layout = models.draft_layout
        block = layout.block_size if layout is not None else 1
        check_batch_budget(config.max_batched_tokens, block)  # before the KV pools are allocated
        self.num_pages, self.max_model_len = size_memory(config, models, block, tp, num_pages)
        clock.lap("size_memory")
        choice = choose_backend(config, models, block, self.max_model_len, tp)
        backend, self.backend_ms = choice.backend, choice.measured_ms
        clock.lap("choose_backend")
        sizes = RunnerSizes.of(config, self.num_pages, self.max_model_len, block)
        speculate = partial(
            make_speculator,
            draft=models.draft,
            backends=DraftBackends(backend, choice.window_backend),
            widths=verify_widths(config.verify_width, layout),
            max_batch_size=self.batch.size,
            tp=tp,
        )
        self.worker = Worker(self.model, backend, sizes, config, speculate, set(models.eos))
        self.runner, self.speculator = self.worker.runner, self.worker.speculator
        self.instruments = self.worker.instruments  # benchmarks and tests switch them on
        clock.lap("build_runner")
        # A MoE target's experts are graphed only fused (the reference reads routing on the host).
        graphable = backend.graphable and (not self.model.shape.num_experts or fused_kernel())
        if config.cuda_graphs and graphable and self.device.type == "cuda":
            self.capture_graphs()
            clock.lap("capture_graphs")
        # Every prompt token computed, from no cached prefix and no sibling sample's shared
        # pages, when the job asks for prompt log-probabilities: a cached prefix has no logits.
        # (A hybrid target's reuse restarts its linear layers from state snapshots.)
        self.whole_prompts = config.prompt_logprobs is not None
        self.prefix_caching = config.prefix_caching and not self.whole_prompts
        self.built_batch_size = self.batch.size  # graphs and slots exist up to it
        self.stopper = Stopper(models.tokenizer, set(models.eos), self.max_model_len)
        self._grammars = GrammarsOnce(self._make_grammars)
        self._start_job()
        freeze_heap()  # what exists now lives as long as the job: no collection need walk it
        clock.lap("freeze_heap")
        self.startup_seconds = clock.seconds

    def capture_graphs(self) -> None:
        """The steady-state step's CUDA graphs, the target's and the speculator's (off a GPU
        they are emulated: the tests run them so)."""
        self.worker.capture_graphs(self.config.batch_size)

    def new_job(self, max_batch_size: int | None = None) -> None:
        """Start as a fresh engine: no cached prefixes, no width measurements, no counts. The
        models, KV pools and CUDA graphs stay (`batchrun bench --jobs` runs jobs on one), and
        the job may run fewer requests at a time than the engine was built for."""
        if self.num_unfinished:
            raise JobError("an engine starts a new job only when the last one has finished")
        built = self.built_batch_size
        size = min(max_batch_size or built, built)
        if size != self.batch.size:
            self.batch = BatchChoice.given(size)
        self.config = replace(self.config, max_batch_size=size)
        self._start_job()

    def _start_job(self) -> None:
        config, speculator = self.config, self.speculator
        linear = self.runner.linear  # a hybrid target's: reuse restores its state snapshots
        snapshots = SnapshotPool(linear.num_snapshots) if linear is not None else None
        self.pool = PagePool(self.num_pages, config.page_size, self.prefix_caching, snapshots)
        # Prompt tokens a request computes even when a cached prefix or a sibling sample's
        # pages hold them: all of them when whole prompts are computed.
        tail = self.max_model_len if self.whole_prompts else speculator.recompute_tail
        self.scheduler = Scheduler(
            self.pool,
            config.batch_size,
            config.max_batched_tokens,
            decode_width=speculator.block_size,
            min_width=speculator.widths[0],
            recompute_tail=tail,
            recorded=Recorded(self.block_size, config.logprobs, config.prompt_logprobs),
            prefill_beside_decode=config.prefill_beside_decode,
        )
        self.worker.start_job(config.batch_size, config.max_batched_tokens)
        # Constrained requests waiting for their grammar; the scheduler fails those with none.
        self.compiling = Compiling(self.tp, self.scheduler.fail)
        self._launched: Launched | None = None

    @property
    def max_batch_size(self) -> int:
        """Requests in flight: the job's given or chosen batch (self.batch says which)."""
        return self.config.batch_size

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
        return (
            {
                "target": str(config.target),
                "draft": str(config.draft) if config.draft else None,
                "dtype": str(self.model.lm_head.weight.dtype).removeprefix("torch."),
                "device": str(self.device),
                "tensor_parallel": self.tp.world_size if self.tp is not None else 1,
                "attention_backend_ms": self.backend_ms,  # `auto`'s measurement, when it chose
                # What speculation buys: tokens a decoding request commits per target forward.
                "tokens_per_target_forward": self.scheduler.tokens_per_round,
                "prefix_caching": self.prefix_caching,  # off for prompt logprobs
                "prefix_cache_hit_rate": self.pool.hit_rate,
                "prompt_tokens_computed": self.scheduler.prompt_tokens_computed,
                "startup_seconds": self.startup_seconds,
            }
            | self.batch.record()
            | self.worker.info()
        )

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
        """The structured outputs' compiler (engine/compiling.py)."""
        return self._grammars.get()

    def _make_grammars(self) -> Grammars:
        """Only rank 0 holds compiles to the time budget (engine/compiling.py)."""
        budget = self.config.compile_budget
        if self.tp is not None and self.tp.rank != 0:
            budget = replace(budget, seconds=None)
        return Grammars(self.tokenizer, self.vocab_size, self.stopper.eos_ids, budget)

    def _admit_compiled(self) -> list[Request]:
        """Constrained requests whose compile is over join the queue; returns those finished
        as errors."""
        if not self.compiling:
            return []
        return self.compiling.admit_ready(self.grammars, self.scheduler, self.stopper.think)

    def abort_all(self) -> None:
        """Drop every unfinished request and free its pages (benchmarks between points)."""
        self.worker.abort(self._launched)
        self._launched = None
        self.scheduler.abort_all()
        self.compiling.clear()

    # -- one step -----------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Launch the next step, then apply the one before; returns the requests it finished."""
        failed = self._admit_compiled()
        scheduler, worker = self.scheduler, self.worker
        slots = [req.state.slot for req in scheduler.running]
        widths = worker.next_widths(slots, scheduler.prefill_pending)
        scheduled, previous, self._launched = scheduler.schedule(widths), self._launched, None
        if not scheduled.items:
            if previous is None and self.compiling:  # nothing runs but compiles: wait a bit
                self.compiling.wait(self.grammars)
            return failed + self._apply(previous)
        forward = worker.launch_forward(scheduled)
        if forward.constrained:  # its masks start from the tokens the step before commits
            failed, previous = failed + self._apply(previous), None
        grammars = self.grammars if forward.constrained else None
        self._launched = worker.launch_sampling(forward, grammars)
        return failed + self._apply(previous)

    def _apply(self, launched: Launched | None) -> list[Request]:
        """Read a launched step's results back and have the scheduler apply them; returns the
        requests it finished."""
        if launched is None:
            return []
        output = self.worker.read(launched)
        rounds = self.instruments.rounds
        return self.scheduler.update_from_output(output, stopper=self.stopper, rounds=rounds)

"""The worker: runs the steps the scheduler decides, on the device, and reads their results back.

It owns the model runner (the target, its KV pool and CUDA graphs), the speculator, the per-slot
device state (page tables, lengths, anchors, the sampling tables: engine/device_state.py) and
sampling. It reads only the scheduler's snapshots (core/step.py) and what the requests asked,
writes only device state, and hands back what the host read as a `StepOutput`, which the
scheduler applies: the scheduler alone writes request state.

A step is launched in two halves (`launch_forward`, then `launch_sampling`) because a step with
constrained rows builds its grammar masks between them, after the engine has applied the step
before it; `read` then brings its results back.

The per-slot device state is one row per slot, filled once when a request takes a slot
(`launch_forward`: the step's admitted items) and updated on the device by each step's commit;
memory.py sizes a slot from its declared bytes (PER_SLOT_BYTES). A hybrid target's fixed-size
recurrent state is slot state too (the runner's LinearSlots, engine/linear_slots.py: a request's
state slot is its device-state slot); a verify step's commit into it follows acceptance.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from batchrun.attention.base import AttentionBackend
from batchrun.engine.config import EngineConfig
from batchrun.engine.core.step import ScheduledStep, StepOutput
from batchrun.engine.device_state import DeviceState
from batchrun.engine.in_flight import Forward, Launched, copy_to_host
from batchrun.engine.instruments import Instruments, StepTimer
from batchrun.engine.model_runner import ModelRunner, RunnerSizes
from batchrun.engine.step_inputs import plan_step
from batchrun.engine.step_times import StepTimes
from batchrun.engine.step_trace import StepRecord
from batchrun.models.qwen3 import Qwen3ForCausalLM
from batchrun.sampling.grammar import Grammars
from batchrun.sampling.grammar_masks import build_masks
from batchrun.sampling.logprobs import ReadLogprobs, prompt_rows
from batchrun.sampling.penalties import VerifyRows
from batchrun.sampling.step_sampling import (
    SampledRows,
    processed_logits,
    sample_tokens,
    score_tokens,
    verified_tokens,
)
from batchrun.spec_decode.base import Speculator, TargetView


class Worker:
    def __init__(
        self,
        model: Qwen3ForCausalLM,
        backend: AttentionBackend,
        sizes: RunnerSizes,
        config: EngineConfig,
        speculate: Callable[[TargetView], Speculator],
        eos_ids: set[int],
    ) -> None:
        """On the model's device. speculate: builds the speculator from a view of the target;
        eos_ids: what min_tokens masks."""
        self.model = model
        self.device = device = model.lm_head.weight.device
        vocab = model.shape.vocab_size
        self.state = DeviceState(sizes.max_batch_size, sizes.max_pages, vocab, device)
        self.state.sampling.controls.eos_ids = frozenset(eos_ids)
        self.runner = ModelRunner(
            model, backend, sizes, self.state, config.kv_cache_dtype, speculate=speculate
        )
        self.speculator = self.runner.speculator
        self.logprobs, self.prompt_logprobs = config.logprobs, config.prompt_logprobs
        self.instruments = Instruments(StepTimer(device))
        self.step_kinds: Counter[str] = Counter()  # prefill, mixed, decode -> steps
        self.step_times = StepTimes()  # their pipeline periods, by kind and width
        self._last_done: float | None = None  # when the host last read a step's results

    def start_job(self, max_batch_size: int, max_batched_tokens: int) -> None:
        """No width measurements, no counts: a job starts afresh on the same device state."""
        self.speculator.start_job(max_batch_size, max_batched_tokens)
        self.step_kinds, self.step_times, self._last_done = Counter(), StepTimes(), None

    def capture_graphs(self, max_batch_size: int) -> None:
        """The target's graphs at each width the speculator may verify at, then its own."""
        self.runner.capture_graphs(max_batch_size, self.speculator.widths)

    def info(self) -> dict[str, Any]:
        """What the job's statistics say of the device side."""
        runner = self.runner
        return (
            {
                "attention_backend": runner.backend.name,
                "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
                "steps": dict(self.step_kinds),
                "cuda_graphs": bool(runner.target_graphs),
            }
            | self.step_times.info()
            | self.speculator.info()
        )

    def next_widths(self, slots: list[int], prefill_pending: bool) -> dict[int, int]:
        """The verify width of each running request (by slot) in the next step (1 without a
        draft)."""
        return self.speculator.next_widths(slots, prefill_pending)

    @torch.inference_mode()
    def launch_forward(self, step: ScheduledStep) -> Forward:
        """Launch the step's drafts and target forward."""
        runner, speculator = self.runner, self.speculator
        batch = step.items
        started = time.perf_counter()
        sampled = SampledRows([it.req.params for it in batch], [it.num_sampled for it in batch])
        decoding = all(it.decoding for it in batch)
        pad_to = runner.graph_shape([it.num_new for it in batch]) if decoding else None
        if step.admitted:  # new slots' state, sent once
            slots = self.state.admit(step.admitted)
            speculator.admit([it.req for it in step.admitted], slots)
        plan = plan_step(batch, self.state.num_slots, pad_to)
        self.step_kinds[plan.kind] += 1
        k = self.prompt_logprobs
        prompt = prompt_rows(batch, k) if k is not None else None
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
            args=args,
            out=out,
            drafts=drafts,
            constrained=constrained,
            drafts_host=drafts_host,
            prompt=prompt,
            started=started,
        )

    @torch.inference_mode()
    def launch_sampling(self, forward: Forward, grammars: Grammars | None) -> Launched:
        """Launch the step's sampling (a constrained step's under the grammar masks built now,
        from `grammars`' compiles), acceptance and commit into the device state, and the copy
        of its results."""
        speculator = self.speculator
        plan, args, out, drafts = forward.plan, forward.args, forward.out, forward.drafts
        sampled, prompt = forward.sampled, forward.prompt
        masks = None
        if forward.constrained:
            assert grammars is not None, "a constrained step samples under its grammars"
            masks = build_masks(grammars, forward.constrained_rows(), self.device)
        tables, d = self.state.sampling, plan.num_decoding
        widths = args.q_len[:d]  # each decoding request's rows, on the device
        verify = VerifyRows(drafts[:d], widths, plan.decode_rows) if drafts is not None else None
        logits = processed_logits(self.model, tables, out, sampled, verify, masks)
        tokens = sample_tokens(self.model, tables, out, sampled, logits)
        proposal = speculator.proposal(plan)
        if proposal is not None and verify is not None:  # drafts sampled from a distribution
            tokens = verified_tokens(
                self.model, tables, out, sampled, logits, tokens, proposal, verify, plan.max_width
            )
        scores = None
        if self.logprobs is not None or (prompt is not None and prompt.rows):
            k = self.logprobs
            scores = score_tokens(self.model, tables, out, sampled, tokens, k, prompt, logits)
        accepted = speculator.accept(drafts, tokens, plan, widths)
        self.runner.commit_linear(out, accepted)  # a hybrid target's verify: rejected rows undone
        live = plan.num_live
        slots = args.slot[:live]
        q_lens, counts = args.q_len[:live], args.sampled[:live]
        self.state.commit(
            slots, q_lens, counts, tokens, accepted, d, plan.decode_rows, plan.max_width
        )
        speculator.commit(slots[:d], accepted, plan, widths)
        self.instruments.timer.mark()
        # The step's one device-to-host copy: sampled tokens, accepted counts (drafts if traced).
        parts = [tokens[: sampled.total], accepted]
        traced = self.instruments.rounds is not None and drafts is not None
        if traced and drafts is not None:
            parts.append(drafts.reshape(-1))
        host, ready = copy_to_host(torch.cat(parts))
        seconds = None if ready is not None else time.perf_counter() - forward.started
        return Launched(
            batch=forward.batch,
            plan=plan,
            sampled=sampled,
            host=host,
            ready=ready,
            num_drafts=drafts.shape[1] if traced and drafts is not None else 0,
            seconds=seconds,
            logprobs=scores,
            replayed=out.replayed,
        )

    def read(self, launched: Launched) -> StepOutput:
        """A launched step's results, read back (the speculator learns from them)."""
        if launched.ready is not None:
            launched.ready.synchronize()
        values = launched.host.tolist()
        num_sampled = launched.sampled.total
        num_dec = launched.plan.num_decoding
        tokens, values = values[:num_sampled], values[num_sampled:]
        accepted, drafts = values[:num_dec], values[num_dec:]
        self._learn(launched, accepted)
        return StepOutput(
            items=launched.batch,
            tokens=tokens,
            accepted=accepted,
            drafts=drafts,
            num_drafts=launched.num_drafts,
            scores=ReadLogprobs(launched.logprobs) if launched.logprobs is not None else None,
        )

    def _learn(self, launched: Launched, accepted: list[int]) -> None:
        """A step's time, by kind, and what the speculator learns from it. On a GPU a step
        costs the time between its results and the previous step's: the period of the
        overlapped pipeline, whichever of host and GPU bounds it."""
        done, last = time.perf_counter(), self._last_done
        self._last_done = done
        seconds = launched.seconds if launched.seconds is not None else done - (last or done)
        plan = launched.plan
        self.step_times.record(plan.kind, plan.max_width, seconds)
        if self.instruments.steps is not None:
            record = StepRecord(
                plan.kind, plan.max_width, plan.num_live, plan.num_rows, launched.replayed, seconds
            )
            self.instruments.steps.append(record)
        self.speculator.learn(plan, accepted, seconds)

    def abort(self, launched: Launched | None) -> None:
        """Drop the step in flight (its results unread) and what the speculator learned of
        the requests running."""
        if launched is not None and launched.ready is not None:
            launched.ready.synchronize()
        self._last_done = None
        self.speculator.aborted()

"""The engine: load the models, then step the continuous batch until every request finishes.

One step = (draft forward, when a draft is loaded) + one target forward over every scheduled
request's rows: prefill chunks, plain decode rows, or DFlash verify blocks. A plain decode step
is a verify round of width 1 that drafts nothing, so both paths share one commit rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from batchrun.engine.config import EngineConfig, check_batch_budget
from batchrun.engine.loading import attention_backend, eos_token_ids, load_tokenizer, resolve_device
from batchrun.engine.model_runner import ModelRunner, StepInput, device_tensor
from batchrun.engine.page_pool import PagePool
from batchrun.engine.request import Request
from batchrun.engine.sampler import SamplingBatch, sample
from batchrun.engine.scheduler import Scheduled, Scheduler
from batchrun.engine.stopping import Stopper
from batchrun.errors import JobError
from batchrun.models.dflash_loader import load_dflash
from batchrun.models.loader import load_qwen3
from batchrun.spec.acceptance import RoundTrace, accepted_count
from batchrun.spec.drafter import Drafter

CPU_KV_BUDGET_BYTES = 2 << 30
ROPE_HEADROOM = 1024  # verify/draft rows may run past the context end; their tokens are cut


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        backend = attention_backend(config.attention_backend)
        target_dir = Path(config.target)
        self.model, model_config = load_qwen3(target_dir, config.dtype, self.device, ROPE_HEADROOM)
        shape = self.model.shape
        max_positions = shape.max_position_embeddings + ROPE_HEADROOM
        self.draft = (
            load_dflash(Path(config.draft), self.model, self.device, max_positions)
            if config.draft
            else None
        )
        self.tokenizer = load_tokenizer(target_dir)
        self.vocab_size = shape.vocab_size
        self.block_size = self.draft.block_size if self.draft else None
        width = self.block_size or 1
        check_batch_budget(config.max_batched_tokens, width)  # before the KV pools are allocated

        num_pages = config.num_pages or self._default_num_pages()
        capacity = num_pages * config.page_size
        limit = min(
            config.max_model_len or shape.max_position_embeddings, shape.max_position_embeddings
        )
        self.max_model_len = min(limit, capacity - width)
        if self.max_model_len < 2:
            raise JobError(f"the KV pool ({num_pages} pages of {config.page_size}) is too small")
        self.pool = PagePool(num_pages, config.page_size)
        self.runner = ModelRunner(self.model, backend, num_pages, config.page_size, self.device)
        self.drafter = (
            Drafter(self.draft, self.model, backend, num_pages, config.page_size, self.device)
            if self.draft
            else None
        )
        self.scheduler = Scheduler(
            self.pool, config.max_batch_size, config.max_batched_tokens, decode_width=width
        )
        eos = eos_token_ids(target_dir, model_config, self.tokenizer)
        self.stopper = Stopper(self.tokenizer, eos, self.max_model_len)
        self.round_trace: list[RoundTrace] | None = None  # set to a list to record rounds
        self._backend_name = backend.name
        self._dtype = str(self.model.lm_head.weight.dtype).removeprefix("torch.")

    def _default_num_pages(self) -> int:
        s, cfg = self.model.shape, self.config
        dtype_bytes = self.model.lm_head.weight.element_size()
        layers = s.num_layers + (self.draft.shape.num_layers if self.draft else 0)
        page_bytes = 2 * layers * cfg.page_size * s.num_kv_heads * s.head_dim * dtype_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.85)
        else:
            budget = CPU_KV_BUDGET_BYTES
        # Enough for every request of a full batch at full context, unless memory says less.
        want = cfg.max_batch_size * -(-(s.max_position_embeddings + 64) // cfg.page_size)
        return max(1, min(want, budget // page_bytes))

    def info(self) -> dict[str, Any]:
        return {
            "target": str(self.config.target),
            "draft": str(self.config.draft) if self.config.draft else None,
            "dtype": self._dtype,
            "device": str(self.device),
            "attention_backend": self._backend_name,
        }

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def add(self, request: Request) -> None:
        if self.block_size and request.spec_hist is None:
            request.spec_hist = [0] * self.block_size
        self.scheduler.add(request)

    def step(self) -> list[Request]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        drafts = self.drafter.propose(batch) if self.drafter else {}
        samples = [self._rows_sampled(it) for it in batch]
        inputs, rows, sampled = self._target_rows(batch, drafts, samples)
        capture = self.draft.target_layer_ids if self.draft else ()
        logits, features = self.runner.forward(inputs, rows, capture)
        tokens = sample(logits, self._sampling_batch(sampled)).tolist() if rows else []

        finished, row, pos = [], 0, 0
        for it, k in zip(batch, samples, strict=True):
            req, n = it.req, it.num_new
            feats = features[row : row + n] if features is not None else None
            post = tokens[pos : pos + k]
            row, pos = row + n, pos + k
            if it.decoding:
                self._commit_round(req, drafts.get(id(req), []), post, feats)
            else:
                req.num_cached += n
                if feats is not None:
                    req.pending_features.append(feats)
                if post:  # the first token, sampled from the prompt's last row
                    self.stopper.commit(req, post)
            if req.finish_reason:
                self.scheduler.finish(req)
                finished.append(req)
            else:
                self.pool.shrink(req.pages, req.num_cached)  # release KV past the committed tokens
        return finished

    def _commit_round(
        self, req: Request, drafts: list[int], post: list[int], feats: torch.Tensor | None
    ) -> None:
        """Commits post[0 .. acc] (acc accepted drafts plus the target's own next token)."""
        p, anchor = req.num_cached, req.output_ids[-1]
        acc = accepted_count(drafts, post)
        kept = self.stopper.commit(req, post[: acc + 1])
        req.num_cached = p + acc + 1  # anchor .. d_acc now hold target KV; the bonus is next
        if feats is not None:
            req.pending_features.append(feats[: acc + 1])
        if req.spec_hist is not None:
            req.spec_rounds += 1
            req.spec_hist[kept - 1] += 1
            if self.round_trace is not None:
                committed = req.output_ids[len(req.output_ids) - kept :]
                self.round_trace.append(RoundTrace(req.row_index, p, anchor, drafts, committed))

    def _target_rows(
        self, batch: list[Scheduled], drafts: dict[int, list[int]], samples: list[int]
    ) -> tuple[StepInput, list[int], list[tuple[Request, int]]]:
        """The step's target rows, the flat rows to sample (each item's last `samples[i]`
        rows), and (request, index of the output token it samples) of each."""
        token_ids: list[list[int]] = []
        rows: list[int] = []
        sampled: list[tuple[Request, int]] = []
        row = 0
        for it, k in zip(batch, samples, strict=True):
            req, start, n = it.req, it.req.num_cached, it.num_new
            if it.decoding:
                token_ids.append([req.output_ids[-1], *drafts.get(id(req), [])])
            else:
                token_ids.append(req.token_slice(start, start + n))
            rows += range(row + n - k, row + n)
            sampled += [(req, len(req.output_ids) + j) for j in range(k)]
            row += n
        inputs = StepInput(
            token_ids=token_ids,
            start=[it.req.num_cached for it in batch],
            page_tables=[it.req.pages for it in batch],
        )
        return inputs, rows, sampled

    @staticmethod
    def _rows_sampled(it: Scheduled) -> int:
        """Every row of a decode/verify step; one for a prefill chunk that completes a fresh
        prompt; none for other chunks (a recompute after preemption samples nothing)."""
        if it.decoding:
            return it.num_new
        req = it.req
        return int(not req.output_ids and req.num_cached + it.num_new == len(req.prompt_ids))

    def _sampling_batch(self, sampled: list[tuple[Request, int]]) -> SamplingBatch:
        params = [req.params for req, _ in sampled]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return device_tensor(values, dtype, self.device)

        return SamplingBatch(
            temperature=tensor([p.temperature for p in params], torch.float32),
            top_p=tensor([p.top_p for p in params], torch.float32),
            # A top_k of the vocabulary or more keeps every token, as 0 does.
            top_k=tensor([p.top_k if p.top_k < self.vocab_size else 0 for p in params], torch.long),
            seed=tensor([as_int64(p.seed) for p in params], torch.long),
            step=tensor([step for _, step in sampled], torch.long),
        )


def as_int64(value: int) -> int:
    """A 64-bit seed (any integer, taken mod 2^64) as the int64 with the same bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value

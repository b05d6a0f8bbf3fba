"""The engine: load the models, then step the continuous batch until every request finishes.

One step = (draft forward, when a draft is loaded) + one target forward over every scheduled
request's rows: prefill chunks, plain decode rows, or DFlash verify blocks. A plain decode step
is a verify round of width 1 that drafts nothing, so both paths share one commit rule. Sampling
and acceptance run on the device; one small copy per step brings back what was committed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from batchrun.engine.config import EngineConfig, check_batch_budget
from batchrun.engine.loading import (
    attention_backend,
    eos_token_ids,
    load_tokenizer,
    resolve_device,
)
from batchrun.engine.memory import kv_pages
from batchrun.engine.model_runner import ModelRunner
from batchrun.engine.page_pool import PagePool
from batchrun.engine.request import Request
from batchrun.engine.sampler import sample
from batchrun.engine.scheduler import Scheduled, Scheduler
from batchrun.engine.step_rows import (
    accepted,
    committed_features,
    rows_sampled,
    sampling_batch,
    target_rows,
)
from batchrun.engine.step_timer import StepTimer
from batchrun.engine.stopping import Stopper
from batchrun.errors import JobError
from batchrun.layers.ops import use_ops
from batchrun.models.dflash import DFlashDraft
from batchrun.models.dflash_loader import load_dflash
from batchrun.models.loader import load_qwen3
from batchrun.models.qwen3 import Qwen3ForCausalLM
from batchrun.speculative.acceptance import RoundTrace
from batchrun.speculative.drafter import Blocks, ContextRows, propose

ROPE_HEADROOM = 1024  # verify/draft rows may run past the context end; their tokens are cut


class Engine:
    def __init__(
        self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> None:
        """Loads the models (and the target's tokenizer, unless it is given)."""
        device = resolve_device(config.device)
        target_dir = Path(config.target)
        model, model_config = load_qwen3(target_dir, config.dtype, device, ROPE_HEADROOM)
        max_positions = model.shape.max_position_embeddings + ROPE_HEADROOM
        draft = (
            load_dflash(Path(config.draft), model, device, max_positions) if config.draft else None
        )
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(target_dir)
        eos = eos_token_ids(target_dir, model_config, tokenizer)
        self._setup(config, model, draft, tokenizer, eos, config.num_pages)

    @classmethod
    def from_models(
        cls,
        config: EngineConfig,
        model: Qwen3ForCausalLM,
        draft: DFlashDraft | None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        eos: set[int] | None = None,
        num_pages: int | None = None,
    ) -> Engine:
        """An engine over models already on their device (`batchrun bench --shape`)."""
        engine = cls.__new__(cls)
        engine._setup(config, model, draft, tokenizer, eos or set(), num_pages)
        return engine

    def _setup(
        self,
        config: EngineConfig,
        model: Qwen3ForCausalLM,
        draft: DFlashDraft | None,
        tokenizer: PreTrainedTokenizerBase | None,
        eos: set[int],
        num_pages: int | None,
    ) -> None:
        self.config = config
        self.model, self.draft = model, draft
        self.device = model.lm_head.weight.device
        self._tokenizer = tokenizer
        shape = model.shape
        self.vocab_size = shape.vocab_size
        self.block_size = draft.block_size if draft else None
        width = self.block_size or 1
        check_batch_budget(config.max_batched_tokens, width)  # before the KV pools are allocated

        num_pages = num_pages or kv_pages(
            config, shape, draft.shape if draft else None,
            len(draft.target_layer_ids) if draft else 0,
            model.lm_head.weight.element_size(), width, self.device,
        )  # fmt: skip
        capacity = num_pages * config.page_size
        limit = min(
            config.max_model_len or shape.max_position_embeddings, shape.max_position_embeddings
        )
        self.max_model_len = min(limit, capacity - width)
        if self.max_model_len < 2:
            raise JobError(f"the KV pool ({num_pages} pages of {config.page_size}) is too small")
        self.pool = PagePool(num_pages, config.page_size)
        heads = max(shape.num_heads, draft.shape.num_heads if draft else 0)
        backend, ops = attention_backend(
            config.attention_backend, self.device, config.max_batch_size * width, heads,
            shape.num_kv_heads, shape.head_dim,
        )  # fmt: skip
        use_ops(model, ops)
        if draft is not None:
            use_ops(draft, ops)
        self.runner = ModelRunner(model, draft, backend, num_pages, config.page_size, self.device)
        if config.cuda_graphs and backend.graphable and self.device.type == "cuda":
            self.runner.capture_graphs(config.max_batch_size, self.max_model_len)
        self.scheduler = Scheduler(
            self.pool, config.max_batch_size, config.max_batched_tokens, decode_width=width
        )
        self.stopper = Stopper(tokenizer, eos, self.max_model_len)
        self.timer = StepTimer(self.device)
        self.round_trace: list[RoundTrace] | None = None  # set to a list to record rounds
        self._backend_name = backend.name
        self._dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")

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
            "attention_backend": self._backend_name,
            "cuda_graphs": self.runner.target_graphs is not None,
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

    def abort_all(self) -> None:
        """Drop every unfinished request and free its pages (benchmarks between points)."""
        for req in list(self.scheduler.running):
            self.scheduler.finish(req)
        for req in self.scheduler.waiting:  # preempted ones may hold no pages; fresh ones none
            self.pool.release(req.pages)
        self.scheduler.waiting.clear()

    # -- one step -----------------------------------------------------------------------------

    def step(self) -> list[Request]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        self.timer.mark()
        decoding = [it.req for it in batch if it.decoding]
        drafts = self._propose(batch, decoding)
        self.timer.mark()
        samples = [rows_sampled(it) for it in batch]
        ids, host, rows = target_rows(batch, samples, drafts, self.pool.page_size, self.device)
        logits, features = self.runner.forward(ids, host, rows)
        tokens = self._sample(logits, batch, samples)
        accepted_dev = accepted(batch, samples, tokens, drafts)
        self.timer.mark()
        # The step's one device-to-host copy: sampled tokens, then accepted counts.
        host_out = torch.cat((tokens, accepted_dev)).tolist()
        post_all, acc_all = host_out[: len(tokens)], host_out[len(tokens) :]
        drafts_host = drafts.tolist() if drafts is not None and self.round_trace is not None else []

        committed = committed_features(batch, acc_all, features)
        finished, pos, dec = [], 0, 0
        for it, k in zip(batch, samples, strict=True):
            req = it.req
            feats = next(committed) if committed is not None else None
            post = post_all[pos : pos + k]
            pos += k
            if it.decoding:
                acc = acc_all[dec] if drafts is not None else 0
                self._commit_round(req, post, acc, feats, drafts_host[dec] if drafts_host else [])
                dec += 1
            else:
                req.num_cached += it.num_new
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

    def _propose(self, batch: list[Scheduled], decoding: list[Request]) -> torch.Tensor | None:
        """Write the draft context of newly committed tokens, then draft a block for every
        decoding request: [R_decoding, B-1] on the device (None without a draft)."""
        if self.draft is None or self.block_size is None:
            return None
        context = []
        for it in batch:
            req = it.req
            if req.pending_features:
                rows = torch.cat(req.pending_features)
                context.append(ContextRows(rows, req.draft_cached, req.pages))
                req.draft_cached += rows.shape[0]
                req.pending_features.clear()
        for req in decoding:
            assert req.draft_cached == req.num_cached, "draft context must end at the anchor"
        blocks = Blocks(
            anchors=[r.output_ids[-1] for r in decoding],
            starts=[r.num_cached for r in decoding],
            page_tables=[r.pages for r in decoding],
        )
        return propose(self.runner, context, blocks, self.block_size, self.draft.mask_token_id)

    def _sample(
        self, logits: torch.Tensor, batch: list[Scheduled], samples: list[int]
    ) -> torch.Tensor:
        sampling = (it.req for it, k in zip(batch, samples, strict=True) if k)
        if all(req.params.temperature == 0 for req in sampling):
            return logits.argmax(dim=-1)
        return sample(logits, sampling_batch(batch, samples, self.vocab_size, self.device))

    def _commit_round(
        self, req: Request, post: list[int], acc: int, feats: torch.Tensor | None, drafts: list[int]
    ) -> None:
        """Commits post[0 .. acc] (acc accepted drafts plus the target's own next token)."""
        p, anchor = req.num_cached, req.output_ids[-1]
        kept = self.stopper.commit(req, post[: acc + 1])
        req.num_cached = p + acc + 1  # anchor .. d_acc now hold target KV; the bonus is next
        if feats is not None:
            req.pending_features.append(feats)
        if req.spec_hist is not None:
            req.spec_rounds += 1
            req.spec_hist[kept - 1] += 1
            if self.round_trace is not None:
                committed = req.output_ids[len(req.output_ids) - kept :]
                self.round_trace.append(RoundTrace(req.row_index, p, anchor, drafts, committed))

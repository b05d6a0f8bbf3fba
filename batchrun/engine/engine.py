"""The engine: load the models, then step the continuous batch until every request finishes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from batchrun.engine.config import EngineConfig
from batchrun.engine.model_runner import ModelRunner, StepInput
from batchrun.engine.page_pool import PagePool
from batchrun.engine.request import Request
from batchrun.engine.sampler import SamplingBatch, sample
from batchrun.engine.scheduler import Scheduled, Scheduler
from batchrun.engine.stopping import Stopper
from batchrun.errors import JobError
from batchrun.kernels.torch_attention import TorchAttention
from batchrun.models.loader import load_qwen3

CPU_KV_BUDGET_BYTES = 2 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise JobError("device 'cuda' was asked for but no CUDA device is available")
    return torch.device(name)


def attention_backend(name: str, device: torch.device) -> type[TorchAttention]:
    if name in ("auto", "torch"):
        return TorchAttention
    raise JobError(f"attention backend {name!r} is not available in this build; use 'torch'")


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # transformers raises many kinds; any of them means no tokenizer
        raise JobError(f"cannot load the tokenizer of {model_dir}: {e}".splitlines()[0]) from None


def eos_token_ids(
    model_dir: Path, config: dict[str, Any], tok: PreTrainedTokenizerBase
) -> set[int]:
    """End-of-sequence ids as generate() uses them: generation_config.json, else the config."""
    import json

    eos = None
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id", tok.eos_token_id)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        backend = attention_backend(config.attention_backend, self.device)
        self.model, model_config = load_qwen3(Path(config.target), config.dtype, self.device)
        self.tokenizer = load_tokenizer(Path(config.target))
        shape = self.model.shape
        self.vocab_size = shape.vocab_size
        self.block_size: int | None = None
        width = 1

        num_pages = config.num_pages or self._default_num_pages()
        capacity = num_pages * config.page_size
        limit = config.max_model_len or shape.max_position_embeddings
        self.max_model_len = min(limit, shape.max_position_embeddings, capacity - width)
        if self.max_model_len < 2:
            raise JobError(f"the KV pool ({num_pages} pages of {config.page_size}) is too small")
        self.pool = PagePool(num_pages, config.page_size)
        self.runner = ModelRunner(self.model, backend, num_pages, config.page_size, self.device)
        self.scheduler = Scheduler(
            self.pool, config.max_batch_size, config.max_batched_tokens, decode_width=width
        )
        eos = eos_token_ids(Path(config.target), model_config, self.tokenizer)
        self.stopper = Stopper(self.tokenizer, eos, self.max_model_len)
        self._backend_name = backend.name
        self._dtype = str(self.model.lm_head.weight.dtype).removeprefix("torch.")

    def _default_num_pages(self) -> int:
        s, cfg = self.model.shape, self.config
        dtype_bytes = self.model.lm_head.weight.element_size()
        page_bytes = 2 * s.num_layers * cfg.page_size * s.num_kv_heads * s.head_dim * dtype_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.85)
        else:
            budget = CPU_KV_BUDGET_BYTES
        # Enough for every request of a full batch at full context, unless memory says less.
        want = cfg.max_batch_size * -(-s.max_position_embeddings // cfg.page_size)
        return max(1, min(want, budget // page_bytes))

    def info(self) -> dict[str, Any]:
        return {
            "target": str(self.config.target),
            "draft": None,
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
        self.scheduler.add(request)

    def step(self) -> list[Request]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        step = StepInput(
            token_ids=[
                it.req.token_slice(it.req.num_cached, it.req.num_cached + it.num_new)
                for it in batch
            ],
            start=[it.req.num_cached for it in batch],
            page_tables=[it.req.pages for it in batch],
        )
        sampling = [it for it in batch if self._samples(it)]
        rows, row = [], 0
        for it in batch:
            row += it.num_new
            if self._samples(it):
                rows.append(row - 1)
        tokens: list[int] = []
        if rows:
            logits, _ = self.runner.forward(step, rows)
            tokens = sample(logits, self._sampling_batch(sampling)).tolist()
        else:
            self.runner.forward(step, [])
        for it in batch:
            it.req.num_cached += it.num_new
        finished = []
        for it, token in zip(sampling, tokens, strict=True):
            self.stopper.commit(it.req, [token])
            if it.req.finish_reason:
                self.scheduler.finish(it.req)
                finished.append(it.req)
        return finished

    @staticmethod
    def _samples(it: Scheduled) -> bool:
        """A decode step samples; a prefill chunk samples only when it ends a fresh prompt."""
        req = it.req
        return it.decoding or (
            not req.output_ids and req.num_cached + it.num_new == len(req.prompt_ids)
        )

    def _sampling_batch(self, items: list[Scheduled]) -> SamplingBatch:
        params = [it.req.params for it in items]
        dev = self.device
        return SamplingBatch(
            temperature=torch.tensor(
                [p.temperature for p in params], dtype=torch.float32, device=dev
            ),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev),
            seed=torch.tensor([p.seed for p in params], dtype=torch.long, device=dev),
            step=torch.tensor(
                [len(it.req.output_ids) for it in items], dtype=torch.long, device=dev
            ),
        )

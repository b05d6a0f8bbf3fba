"""The engine's settings that a job sets, each declared once (batchrun/sampling/option.py): its
type, range, default, help and fingerprint record. EngineConfig (engine/config.py) is made of
them, and the job's engine part (config/parts.py) derives its keys and flags from them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from batchrun.sampling.grammar_compile import COMPILE_SECONDS, MAX_CONSTRAINT_BYTES, CompileBudget
from batchrun.sampling.option import Kind, Record, option

# Sanity maxima of the batch limits, so that an absurd number is refused before any model file
# is read; what a device can really hold is checked at start-up, from the model's shapes
# (engine/memory.py, check_batch_memory). 65,536 requests in flight: each holds at least a page
# of K/V and samples a row of float32 logits, which at Qwen3's vocabulary of 151,936 are 40 GB
# for 65,536 rows alone, and vLLM's default is 256 (its largest CUDA graph 512). 2^24 tokens per
# forward: 400 full 40,960-token contexts; at Qwen3-8B's hidden size (4,096, bfloat16) the
# residual stream of such a forward alone is 128 GiB.
MAX_BATCH_SIZE = 1 << 16
MAX_BATCHED_TOKENS = 1 << 24


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """How the engine runs the models, in job-key order; not what a row asks."""

    speculative_method: str = option(
        "auto",
        kind=Kind.TEXT,
        schema={"pattern": "^[a-z][a-z0-9_]*$"},
        doc="The speculation method that runs the draft: auto (the one whose architectures the "
        "draft's config.json names) or a method's name. Speculation is "
        "lossless: the method changes speed, never outputs.",
        help="auto (by the draft's config.json architectures) or a method's name.",
    )

    # A constraint whose text is longer, or whose compile takes longer, is its row's error.
    max_constraint_bytes: int = option(
        MAX_CONSTRAINT_BYTES,
        kind=Kind.INT,
        low=1,
        doc="A json_schema, regex or choice (its grammar's text) longer than this many bytes is "
        "not compiled: its row is an error row (a job key's: the job is refused).",
        help="A constraint longer than this is not compiled: its row is an error row.",
    )
    grammar_compile_timeout: float = option(
        COMPILE_SECONDS,
        kind=Kind.FLOAT,
        low=0,
        low_open=True,
        doc="Seconds a constraint's grammar may take to compile (off the step "
        "loop: other rows decode meanwhile); a longer compile is given up and its row is an "
        "error row (a job key's: the job is refused).",
        help="Seconds a constraint may take to compile; then its row is an error row.",
    )
    # The fingerprint records the dtype resolved for the target and device (config/fingerprint.py).
    dtype: str = option(
        "auto",
        kind=Kind.TEXT,
        schema={"enum": ["auto", "float32", "bfloat16", "float16"]},
        doc="Model weight and activation dtype.",
        help="auto, float32, bfloat16 or float16.",
        record=Record.ALWAYS,
    )
    device: str = option(
        "auto",
        kind=Kind.TEXT,
        schema={"pattern": "^(auto|cpu|cuda(:[0-9]+)?)$"},
        doc="Device to run on: auto, cpu, cuda or cuda:N (under torchrun, auto "
        "and cuda become cuda:LOCAL_RANK).",
        help="auto, cpu, cuda or cuda:N.",
    )
    attention_backend: str = option(
        "auto",
        kind=Kind.TEXT,
        schema={"enum": ["auto", "torch", "triton", "flashinfer"]},
        doc="Attention implementation.",
        help="auto (triton on a GPU, torch on a CPU), torch, triton or flashinfer (GPU, eager).",
    )
    # fp8 K/V round what attention reads, so outputs change; auto is no key, as before fp8.
    kv_cache_dtype: str = option(  # auto (the model dtype) | fp8
        "auto",
        kind=Kind.TEXT,
        schema={"enum": ["auto", "fp8"]},
        doc="The target's KV cache: auto (the model dtype) or fp8 (float8_e4m3fn with a scale "
        "per layer for K and one for V, 1.0 uncalibrated: half the bytes of bfloat16, so "
        "about twice the pages; attention reads the values rounded to 3 mantissa bits, so "
        "outputs may differ from auto's). fp8 runs on the torch and triton backends.",
        help="The target's KV cache: auto (the model dtype) or fp8 (float8_e4m3fn, per-layer "
        "scales: about twice the pages; torch and triton backends).",
        record=Record.WHEN_SET,
    )
    cuda_graphs: bool = option(
        True,
        kind=Kind.BOOL,
        doc="Capture CUDA graphs for decode steps (GPU only).",
        help="CUDA graphs for decode/verify steps.",
    )
    prefix_caching: bool = option(  # reuse the K/V of full pages whose tokens a request shares
        True,
        kind=Kind.BOOL,
        doc="Reuse the K/V of full pages of prompt tokens that rows share (automatic prefix "
        "caching).",
        help="Reuse the K/V of prompt prefixes that rows share.",
    )
    verify_width: int | str = option(  # rows verified per request and step: auto, full, 1 .. B
        "auto",
        kind=Kind.SCHEMA,
        schema={"anyOf": [{"enum": ["auto", "full"]}, {"type": "integer", "minimum": 1}]},
        doc="Tokens verified per request and step with a draft: auto (chosen each "
        "step from measured step costs and acceptance), full (the draft's block size) or "
        "1 up to the block size.",
        help="Tokens verified per request and step with a draft: auto (chosen each step from "
        "measured costs and acceptance), full (the block) or 1 .. the draft's block size.",
    )
    # Unset: chosen at start-up (engine/batch_choice.py); stats.json records the batch and how.
    max_batch_size: int | None = option(
        None,
        kind=Kind.INT,
        low=1,
        high=MAX_BATCH_SIZE,
        doc=f"Requests in flight in the engine at once (at most {MAX_BATCH_SIZE}, and what the "
        "device's memory holds). Unset: chosen at start-up from the KV cache memory holds and "
        "the decode step's cost (docs/jobs.md); 64 on a CPU.",
        help="Requests in flight (unset: chosen at start-up from memory and step cost).",
        unset="auto",
    )
    max_batched_tokens: int = option(  # prefill chunks + decode/verify rows
        4096,
        kind=Kind.INT,
        low=1,
        high=MAX_BATCHED_TOKENS,
        doc=f"Tokens per forward pass (prefill chunks + decode; at most {MAX_BATCHED_TOKENS}, "
        "and what the device's memory holds).",
        help="Tokens per forward pass.",
    )
    # Stall-free batching (Sarathi-Serve's): a step that decodes carries a prompt chunk of at
    # most this many tokens, so it costs little more than its decode part and the rows start
    # decoding (and finish) staggered, later rows' prefill riding on earlier rows' decode.
    # Unset, as the GPU decided: on an H100 W1 at batch 128 ran 0.57x, 0.91x and 0.97x of
    # uncapped at 256, 512 and 768 (a mixed step pays its prompt's matmuls on top of its decode
    # rows' K/V reads, eagerly; docs/benchmarks.md), where the fitted replay had priced +13%.
    prefill_beside_decode: int | None = option(
        None,
        kind=Kind.INT,
        low=1,
        high=MAX_BATCHED_TOKENS,
        doc="The most prompt tokens a step that decodes takes beside its decode rows "
        "(stall-free batching: smaller chunks keep each decode step near its own cost and let "
        "later rows' prefill ride on earlier rows' decode). Unset: the rest of "
        "max_batched_tokens. Outputs do not change.",
        help="Prompt tokens a decoding step takes at most.",
        unset="the rest of the token budget",
    )
    gpu_memory_fraction: float = option(  # weights, graphs, activations, then KV
        0.9,
        kind=Kind.FLOAT,
        low=0,
        low_open=True,
        high=1,
        doc="Fraction of the GPU's memory batchrun may use: the KV pools get "
        "what is left of it after weights, CUDA graphs and activations.",
        help="GPU memory batchrun may use (KV pools last).",
    )

    @property
    def compile_budget(self) -> CompileBudget:
        """Structured outputs: a constraint over its size or its compile time is its row's
        error."""
        return CompileBudget(self.grammar_compile_timeout, self.max_constraint_bytes)


def engine_options(settings: EngineOptions) -> dict[str, Any]:
    """The engine options of `settings` (an EngineConfig, or the job's engine part), by name:
    what one hands the other."""
    return {item.name: getattr(settings, item.name) for item in dataclasses.fields(EngineOptions)}

"""FP8 KV caches (kv_cache_dtype fp8): the torch backend attends over exactly the fp8-rounded
K/V; an engine over FP8 pools gives the outputs of one whose float32 pools hold the rounded K/V,
agrees with the float32-KV engine until a step where that one's top-1/top-2 gap is small, keeps a
draft's K/V in the model dtype and still speculates exactly; the pools hold about twice the
pages of bfloat16 ones; a bad value, and flashinfer with fp8, are refused in one line. The Triton
kernels' FP8 cases are in test_triton_kernels.py, the engine's on Triton in
test_triton_engine.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from batchrun.attention.kv_dtype import FP8, kv_dtype
from batchrun.attention.meta import AttentionMeta
from batchrun.attention.torch_backend import TorchAttention
from batchrun.cli import cli
from batchrun.config.job import JobSpec
from batchrun.engine import attention_backends
from batchrun.engine.attention_backends import auto_candidates, check_backend_kv
from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from batchrun.engine.memory import CPU_KV_BUDGET_BYTES, BatchFootprint, kv_pages
from batchrun.errors import JobError
from batchrun.models.loader import qwen3_shape, read_config
from batchrun.sampling.params import SamplingParams
from batchrun.spec_decode.dflash.speculator import DFlashSpeculator
from tests.helpers.dflash_train import trained_draft_beside
from tests.helpers.engine_runs import requests_of, run_to_end

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
# Where the float32-KV run's greedy choice is decided by more than this (nats between its top
# two tokens), FP8 K/V must not change it. On the tiny target the FP8 run first departs at gaps
# of at most 0.5 (32 rows, 32 tokens; the rounding moves a first token's log-probability by up
# to 0.42): random tiny weights attend sharply, so 3-bit mantissas move their logits more than
# a trained model's.
DECIDED_GAP = 1.0


def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x through an FP8 cache by hand: x / scale saturated, to e4m3 and back, times scale."""
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def test_torch_backend_attends_over_the_fp8_rounded_kv() -> None:
    """write_kv into FP8 caches stores the rounded rows (saturated past 448 x scale), and
    attend over them equals attention over float32 caches holding the rounded K/V."""
    gen = torch.Generator().manual_seed(0)
    hq, hkv, dim, page, pages = 4, 2, 16, 4, 12
    k_scale, v_scale = 0.5, 2.0
    # Two requests: 6 cached positions + 3 new rows (a prefill chunk), 9 cached + 1 new (decode).
    table = torch.tensor([[3, 7, 1], [0, 5, 9]], dtype=torch.int32)
    kv_lens, q_lens = [9, 10], [3, 1]
    positions = torch.tensor([6, 7, 8, 9])
    slots = torch.stack(
        [
            table[r, p // page] * page + p % page
            for r, p in zip([0, 0, 0, 1], positions.tolist(), strict=True)
        ]
    ).long()
    meta = AttentionMeta(
        positions=positions,
        kv_index=slots,
        cu_q=torch.tensor([0, 3, 4], dtype=torch.int32),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
        page_table=table,
        page_size=page,
        max_q=max(q_lens),
        max_kv=max(kv_lens),
    )
    context_k = torch.randn(pages, page, hkv, dim, generator=gen) * 3
    context_v = torch.randn(pages, page, hkv, dim, generator=gen) * 3
    q = torch.randn(4, hq, dim, generator=gen)
    k = torch.randn(4, hkv, dim, generator=gen) * 3
    v = torch.randn(4, hkv, dim, generator=gen) * 3
    k[0, 0, :2] = torch.tensor([1e4, -1e4])  # saturated: 448 x its scale
    kv_scale = torch.tensor([k_scale, v_scale])

    backend = TorchAttention()
    backend.plan(meta)
    k8 = (context_k / k_scale).to(FP8)  # the cached context, already FP8
    v8 = (context_v / v_scale).to(FP8)
    backend.write_kv(k, v, k8, v8, kv_scale=kv_scale)
    got = backend.attend(q, k8, v8, dim**-0.5, kv_scale)

    ref_k, ref_v = k8.float() * k_scale, v8.float() * v_scale  # the context as FP8 holds it
    ref_k.view(-1, hkv, dim)[slots] = rounded(k, k_scale)
    ref_v.view(-1, hkv, dim)[slots] = rounded(v, v_scale)
    assert torch.equal(k8.float() * k_scale, ref_k) and torch.equal(v8.float() * v_scale, ref_v)
    assert k8.view(-1, hkv, dim)[slots[0], 0, :2].float().tolist() == [448.0, -448.0]
    want = backend.attend(q, ref_k, ref_v, dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


class RoundedKV(TorchAttention):
    """The torch reference over float32 caches that hold K/V rounded through e4m3 (scale 1)."""

    def write_kv(
        self, k: Any, v: Any, k_cache: Any, v_cache: Any, kv_index: Any = None, kv_scale: Any = None
    ) -> None:
        super().write_kv(rounded(k, 1.0), rounded(v, 1.0), k_cache, v_cache, kv_index)


def greedy_work(count: int, max_tokens: int, seed: int = 0) -> list[tuple[list[int], Any]]:
    gen = torch.Generator().manual_seed(seed)
    work = []
    for _ in range(count):
        length = int(torch.randint(1, 60, (1,), generator=gen))
        prompt = torch.randint(3, 1000, (length,), generator=gen).tolist()
        work.append((prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    return work


def engine(target: Path, draft: Path | None = None, **settings: Any) -> Engine:
    config: dict[str, Any] = {
        "device": "cpu",
        "dtype": "float32",
        "attention_backend": "torch",
        "page_size": 4,
        "max_batch_size": 16,
        "max_batched_tokens": 256,
        "num_pages": 1200,
    } | settings
    return Engine(EngineConfig(target=target, draft=draft, **config))


def test_an_fp8_engine_runs_on_the_rounded_kv(target: Path) -> None:
    """FP8 pools (scales 1.0): every row gets its tokens, exactly those of an engine whose
    float32 pools hold the K/V rounded to e4m3, through prefill chunks and decode steps."""
    work = greedy_work(16, 24)
    fp8 = engine(target, kv_cache_dtype="fp8", max_batched_tokens=48)
    assert all(k.dtype == v.dtype == FP8 for k, v in fp8.runner.kv_caches)
    assert fp8.runner.kv_scales is not None and bool((fp8.runner.kv_scales == 1).all())
    assert fp8.info()["kv_cache_dtype"] == "float8_e4m3fn"
    got = run_to_end(fp8, requests_of(work))
    reference = engine(target, max_batched_tokens=48)
    reference.runner.backend = RoundedKV()
    want = run_to_end(reference, requests_of(work))
    assert all(len(r.output.token_ids) == 24 for r in got)
    assert [r.output.token_ids for r in got] == [r.output.token_ids for r in want]
    assert engine(target).info()["kv_cache_dtype"] == "float32"


def test_fp8_agrees_with_float32_kv_where_the_choice_is_decided(target: Path) -> None:
    """Greedy rows under FP8 K/V follow the float32-KV rows token for token until a step whose
    top-1/top-2 gap (float32 KV) is below DECIDED_GAP: every decided step before a row's first
    departure (31 on this target) gave the same token."""
    work = greedy_work(32, 32)
    plain = run_to_end(engine(target, logprobs=2), requests_of(work))
    fp8 = run_to_end(engine(target, logprobs=2, kv_cache_dtype="fp8"), requests_of(work))
    decided = 0
    for a, b in zip(plain, fp8, strict=True):
        assert len(b.output.token_ids) == len(a.output.token_ids) == 32
        assert a.output.logprobs is not None and a.output.logprobs.top is not None
        gaps = [top[0][1] - top[1][1] for top in a.output.logprobs.top]
        pairs = zip(a.output.token_ids, b.output.token_ids, strict=True)
        split = next((i for i, (x, y) in enumerate(pairs) if x != y), None)
        if split is not None:
            assert gaps[split] < DECIDED_GAP, (a.row_index, split, gaps[split])
        decided += sum(gap >= DECIDED_GAP for gap in gaps[: None if split is None else split])
    assert decided >= 24, decided  # the comparison is not empty


def test_a_draft_keeps_its_kv_in_the_model_dtype(target: Path) -> None:
    """With a DFlash draft: the target's pools FP8, the draft's float32; speculation still gives
    exactly the FP8 target's own greedy tokens, accepting runs of drafts."""
    draft = trained_draft_beside(target)
    work = greedy_work(8, 24, seed=1)
    alone = run_to_end(engine(target, kv_cache_dtype="fp8"), requests_of(work))
    spec_engine = engine(target, draft, kv_cache_dtype="fp8", verify_width="full")
    speculator = spec_engine.speculator
    assert isinstance(speculator, DFlashSpeculator)
    assert all(k.dtype == torch.float32 for k, _ in speculator.kv_caches)
    assert all(k.dtype == FP8 for k, _ in spec_engine.runner.kv_caches)
    spec = run_to_end(spec_engine, requests_of(work))
    assert [r.output.token_ids for r in spec] == [r.output.token_ids for r in alone]
    assert sum(r.output.spec_rounds for r in spec) < sum(len(r.output.token_ids) for r in spec)


def test_emulated_graphs_replay_fp8_like_eager(target: Path) -> None:
    """On a CPU the steady-state steps through the graphs' persistent buffers and padding read
    the same scales: the eager tokens, as the batch drains through several ladder sizes."""
    prompts = [prompt for prompt, _ in greedy_work(8, 1, seed=2)]
    work = [
        (p, SamplingParams(max_tokens=3 + 2 * i, ignore_eos=True)) for i, p in enumerate(prompts)
    ]
    eager = run_to_end(engine(target, kv_cache_dtype="fp8", cuda_graphs=False), requests_of(work))
    graphed = engine(target, kv_cache_dtype="fp8", cuda_graphs=False)
    graphed.capture_graphs()
    got = run_to_end(graphed, requests_of(work))
    assert len({size for (_, size) in graphed.runner.replays}) >= 2
    assert [r.output.token_ids for r in got] == [r.output.token_ids for r in eager]


# -- the pool's size ------------------------------------------------------------------------------


def test_fp8_pools_hold_twice_the_pages_of_bfloat16(target: Path) -> None:
    """On a CPU's fixed budget (a batch too large for it): one byte an element against
    bfloat16's two, so twice the pages; a draft's paged layers stay in the model dtype."""
    shape = qwen3_shape(read_config(target))
    config = EngineConfig(target=target, page_size=16, max_batch_size=1 << 16)

    def pages(kv: str, draft_layers: int = 0, element: int = 2) -> int:
        draft = shape if draft_layers else None
        return kv_pages(
            dataclasses.replace(config, kv_cache_dtype=kv),
            shape,
            draft,
            1,
            element,
            1,
            CPU,
            draft_paged_layers=draft_layers,
            ring_pages=0,
        )

    page_bf16 = 2 * 16 * shape.num_kv_heads * shape.head_dim * 2 * shape.num_layers
    assert pages("auto") == CPU_KV_BUDGET_BYTES // page_bf16
    assert pages("fp8") == CPU_KV_BUDGET_BYTES // (page_bf16 // 2)
    assert abs(pages("fp8") / pages("auto") - 2) < 0.01
    assert pages("fp8", element=4) == 4 * pages("auto", element=4)  # float32 models: four
    # A draft's two paged layers stay at two bytes: a page is the target's 4 layers at one
    # byte and the draft's 2 at two (bfloat16: 4 and 2 at two), so 1.5 times the pages.
    assert pages("fp8", draft_layers=2) == CPU_KV_BUDGET_BYTES // page_bf16
    assert pages("auto", draft_layers=2) == CPU_KV_BUDGET_BYTES // (page_bf16 * 3 // 2)
    with pytest.raises(JobError, match="kv_cache_dtype must be auto or fp8"):
        pages("int8")


def test_the_batch_lower_bound_counts_fp8_kv_at_one_byte(target: Path) -> None:
    shape = qwen3_shape(read_config(target))
    bf16 = BatchFootprint(shape, None, weight_bytes=0, element=2)
    fp8 = dataclasses.replace(bf16, kv_element=1)
    kv = 2 * 16 * shape.num_kv_heads * shape.head_dim * shape.num_layers  # a page a slot, bytes
    assert bf16.bytes(64, 64) - fp8.bytes(64, 64) == 64 * kv


# -- refusals and plumbing ------------------------------------------------------------------------


def test_a_bad_kv_cache_dtype_is_refused_in_one_line(tmp_path: Path, target: Path) -> None:
    with pytest.raises(JobError, match="job key 'kv_cache_dtype': 'int8' is not one of"):
        JobSpec.from_keys(dict(input="in", output="out", target="t", kv_cache_dtype="int8"))
    with pytest.raises(JobError, match="kv_cache_dtype must be auto or fp8, got 'fp16'"):
        kv_dtype("fp16", torch.bfloat16)
    with pytest.raises(JobError, match="kv_cache_dtype must be auto or fp8"):
        engine(target, kv_cache_dtype="e5m2")
    pq.write_table(pa.table({"prompt": ["def f(x):"]}), tmp_path / "in.parquet")
    args = ["--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out")]
    args += ["--target", str(target), "--kv-cache-dtype", "fp9"]
    for command in ("run", "validate"):
        result = CliRunner().invoke(cli, [command, *args])
        assert result.exit_code == 2
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and "job key 'kv_cache_dtype': 'fp9' is not one of" in lines[0]


def test_flashinfer_reads_no_fp8_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """flashinfer with fp8 is refused in one line; `auto` does not consider it then."""
    with pytest.raises(JobError, match="'flashinfer' does not read an fp8 KV cache"):
        check_backend_kv("flashinfer", "fp8")
    check_backend_kv("flashinfer", "auto")
    check_backend_kv("triton", "fp8")
    monkeypatch.setattr(attention_backends.importlib.util, "find_spec", lambda name: object())
    gpu = torch.device("cuda")
    assert auto_candidates(gpu, torch.bfloat16) == ("triton", "flashinfer")
    assert auto_candidates(gpu, torch.bfloat16, "fp8") == ("triton",)


def test_validate_prints_the_kv_dtype_and_run_writes_it(tmp_path: Path, target: Path) -> None:
    pq.write_table(pa.table({"prompt": ["def f(x):", "import os"]}), tmp_path / "in.parquet")
    args = ["--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out")]
    args += ["--target", str(target), "--max-tokens", "4", "--quiet", "--device", "cpu"]
    plain = CliRunner().invoke(cli, ["validate", *args])
    assert plain.exit_code == 0 and "attention backend: torch, KV cache: float32" in plain.output
    draft = trained_draft_beside(target)
    fp8 = CliRunner().invoke(
        cli, ["validate", *args, "--kv-cache-dtype", "fp8", "--draft", str(draft)]
    )
    assert fp8.exit_code == 0, fp8.output
    assert "KV cache: float8_e4m3fn (per-layer scales 1.0; the draft's: float32)" in fp8.output
    ran = CliRunner().invoke(cli, ["run", *args, "--kv-cache-dtype", "fp8"])
    assert ran.exit_code == 0, ran.output
    stats = (tmp_path / "out" / "stats.json").read_text()
    assert '"kv_cache_dtype": "float8_e4m3fn"' in stats

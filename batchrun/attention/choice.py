"""`--attention-backend auto` on a GPU where flashinfer is installed: Triton or flashinfer,
whichever runs this job's attention faster, from a short measurement at start-up, cached per
GPU, package versions and shape (a job array's tasks measure once per machine type).

What is timed is one step's attention as the engine runs it: for each forward of a step (plain
decode; with a draft also the B-row verify and the non-causal draft block) a CUDA graph of the
forward's layers attending over a paged context, replayed after the backend's own planning
(flashinfer plans on the host before every replay: that time counts), at the job's largest
batch and a context of up to 1,024 positions.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, cast

import torch

from batchrun.attention.base import AttentionBackend, GraphShape, HostPlanned
from batchrun.attention.meta import AttentionMeta

MEASURED_BATCH = 256  # at most: larger batches only scale the same kernels
MEASURED_CONTEXT = 1024
TIMED_REPLAYS = 10


@dataclass(frozen=True)
class Workload:
    """The attention one job runs."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    batch: int  # the job's largest (measured at up to MEASURED_BATCH)
    block_size: int  # 1 without a draft
    num_layers: int  # the target's
    draft_layers: int
    context: int

    def forwards(self) -> list[tuple[int, int, bool]]:
        """(layers, rows per request, causal) of each forward a step can run."""
        block = self.block_size
        out = [(self.num_layers, 1, True)]
        if block > 1:
            out += [(self.num_layers, block, True), (self.draft_layers, block, False)]
        return out


def cache_path() -> Path:
    root = os.environ.get("BATCHRUN_CACHE") or Path.home() / ".cache" / "batchrun"
    return Path(root) / "attention-backends.json"


def fastest(
    candidates: dict[str, Callable[[], AttentionBackend]],
    workload: Workload,
    device: torch.device,
    cache: Path | None = None,
) -> tuple[str, dict[str, float]]:
    """The name of the fastest candidate and each one's milliseconds per step's attention,
    from the cache when this GPU, these packages and this workload were measured before."""
    cache = cache or cache_path()
    key = _cache_key(workload, device, sorted(candidates))
    known = _read(cache)
    if key in known:
        return known[key]["choice"], known[key]["ms"]
    ms = {name: step_ms(make(), workload, device) for name, make in candidates.items()}
    choice = min(ms, key=lambda name: ms[name])
    known[key] = {"choice": choice, "ms": ms}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
        tmp.replace(cache)  # atomic: tasks of an array may write at once
    except OSError:
        pass  # a read-only home only costs the next job the measurement
    return choice, ms


def step_ms(backend: AttentionBackend, workload: Workload, device: torch.device) -> float:
    """Milliseconds of one step's attention forwards on `backend` (module docstring)."""
    total = 0.0
    for i, (layers, q_len, causal) in enumerate(workload.forwards()):
        total += _forward_ms(backend, workload, layers, q_len, causal, device, seed=i)
    torch.cuda.empty_cache()
    return total


def _forward_ms(
    backend: AttentionBackend,
    w: Workload,
    layers: int,
    q_len: int,
    causal: bool,
    device: torch.device,
    seed: int,
) -> float:
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, w.dtype)
    batch = min(w.batch, MEASURED_BATCH)
    kv_len = w.context + q_len
    pages_each = -(-kv_len // w.page_size)
    num_pages = batch * pages_each
    shape = (num_pages, w.page_size, w.num_kv_heads, w.head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    q = torch.randn(
        batch * q_len, w.num_heads, w.head_dim, generator=gen, device=device, dtype=dtype
    )
    table = torch.randperm(num_pages, generator=gen, device=device).view(batch, pages_each)
    meta = AttentionMeta(
        positions=(torch.arange(q_len, device=device) + w.context).repeat(batch),
        kv_index=torch.full((batch * q_len,), -1, dtype=torch.long, device=device),
        cu_q=(torch.arange(batch + 1, device=device) * q_len).int(),
        kv_lens=torch.full((batch,), kv_len, dtype=torch.int32, device=device),
        page_table=table.int(),
        page_size=w.page_size,
        max_q=q_len,
        max_kv=kv_len,
        causal=causal,
    )
    scale = w.head_dim**-0.5
    key = (f"choice{seed}", batch)
    host = cast(HostPlanned, backend) if backend.host_planned else None
    graph_shape = GraphShape(batch, q_len, kv_len, w.page_size)
    capture = host.capturing(key, graph_shape) if host else nullcontext()

    def forward() -> None:
        backend.plan(meta)
        for _ in range(layers):
            backend.attend(q, k_cache, v_cache, scale)

    graph = torch.cuda.CUDAGraph()
    with capture:
        forward()  # warm-up: compiles, plans the largest step
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            forward()
    times = []
    for _ in range(TIMED_REPLAYS + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with host.replaying(key, meta) if host else nullcontext():
            graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times[2:])[TIMED_REPLAYS // 2]


def _cache_key(workload: Workload, device: torch.device, names: list[str]) -> str:
    def package(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "none"

    parts: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": package("triton"),
        "flashinfer": package("flashinfer-python"),
        "candidates": names,
        **asdict(workload),
    }
    return json.dumps(parts, sort_keys=True)


def _read(cache: Path) -> dict[str, Any]:
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}

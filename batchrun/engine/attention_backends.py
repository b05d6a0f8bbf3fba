"""The attention backend a job runs: the name `--attention-backend` resolves to on a device,
what `auto` chooses between (the measurement itself is choice.py's) and the backend built
with the layers' small ops that go with it."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from functools import partial

import torch

from batchrun.attention.base import AttentionBackend
from batchrun.attention.choice import Workload, fastest
from batchrun.attention.torch_backend import TorchAttention
from batchrun.errors import JobError
from batchrun.layers.ops import TORCH_OPS, TorchOps

FLASHINFER_FP8_KV = (
    "attention backend 'flashinfer' does not read an fp8 KV cache; use --attention-backend "
    "triton (or auto) or --kv-cache-dtype auto"
)
TRITON_ON_CPU = (
    "attention backend 'triton' runs on a CPU only in Triton's interpreter: set "
    "TRITON_INTERPRET=1 before the process starts, or use --attention-backend torch"
)
FLASHINFER_NEEDS = (
    "attention backend 'flashinfer' needs a CUDA GPU and the flashinfer-python package "
    "(pip install 'batchrun[flashinfer]')"
)


def backend_name(name: str, device: torch.device) -> str:
    """The backend `name` resolves to on `device`; JobError if it cannot run here. `auto` is
    Triton on a GPU (or flashinfer where it is installed and measures faster: `auto_candidates`)
    and the torch reference on a CPU (where `triton` runs under Triton's interpreter, for tests:
    the process chooses it before triton is first imported, as the CLI and the tests do).
    `flashinfer` runs on a CUDA GPU only; whether it is installed is checked here without
    importing it (its import is slow), the import itself when it is built."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        if not _has_triton():
            raise JobError("attention backend 'triton' needs the triton package")
        if device.type == "cpu" and not triton_interpreted():
            raise JobError(TRITON_ON_CPU)
    elif name == "flashinfer":
        if device.type != "cuda" or importlib.util.find_spec("flashinfer") is None:
            raise JobError(FLASHINFER_NEEDS)
    elif name != "torch":
        raise JobError(
            f"attention backend {name!r} is not available; use auto, triton, flashinfer or torch"
        )
    return name


def auto_candidates(
    device: torch.device, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> tuple[str, ...]:
    """What `auto` chooses between: Triton and, where it is installed and computes in this
    dtype over a KV cache in the model dtype, flashinfer, on a GPU; the torch reference on a
    CPU."""
    if device.type != "cuda":
        return ("torch",)
    half = dtype in (torch.float16, torch.bfloat16) and kv_cache_dtype == "auto"
    if half and importlib.util.find_spec("flashinfer") is not None:
        return ("triton", "flashinfer")
    return ("triton",)


def check_backend_dtype(name: str, dtype: torch.dtype) -> None:
    """JobError if backend `name` (resolved) cannot compute in `dtype`."""
    if name == "flashinfer":
        from batchrun.attention.flashinfer_backend import check_dtype

        check_dtype(dtype)


def check_backend_kv(name: str, kv_cache_dtype: str) -> None:
    """JobError if backend `name` (resolved) cannot read a KV cache of kv_cache_dtype."""
    if name == "flashinfer" and kv_cache_dtype == "fp8":
        raise JobError(FLASHINFER_FP8_KV)


def triton_interpreted() -> bool:
    """Whether this process runs Triton kernels in Triton's interpreter (TRITON_INTERPRET, read
    when triton is first imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def attention_backend(
    name: str, device: torch.device, workload: Workload, kv_cache_dtype: str = "auto"
) -> tuple[AttentionBackend, TorchOps, dict[str, float] | None]:
    """The attention backend, the layers' small ops that go with it and, when `auto` measured
    its candidates (attention/choice.py), their milliseconds per step's attention."""
    measured = None
    candidates = auto_candidates(device, getattr(torch, workload.dtype), kv_cache_dtype)
    if name == "auto" and len(candidates) > 1:
        makers: dict[str, Callable[[], AttentionBackend]] = {
            c: partial(_attention_only, c, device, workload) for c in candidates
        }
        name, measured = fastest(makers, workload, device)
    name = backend_name(name, device)
    check_backend_kv(name, kv_cache_dtype)
    return (*_backend(name, device, workload), measured)


def _attention_only(name: str, device: torch.device, workload: Workload) -> AttentionBackend:
    return _backend(name, device, workload)[0]


def _backend(
    name: str, device: torch.device, workload: Workload
) -> tuple[AttentionBackend, TorchOps]:
    if name == "torch":
        return TorchAttention(), TORCH_OPS
    if name == "flashinfer":
        return _flashinfer_backend(device)
    from batchrun.attention.triton_backend import TritonAttention
    from batchrun.layers.triton_ops import TritonOps

    w = workload
    rows = w.batch * w.block_size  # forwards of at most this many rows may split K/V
    return TritonAttention(rows, w.num_heads, w.num_kv_heads, w.head_dim), TritonOps()


def _flashinfer_backend(device: torch.device) -> tuple[AttentionBackend, TorchOps]:
    """flashinfer's attention with Triton's K/V write and small ops where triton imports."""
    from batchrun.attention.flashinfer_backend import FlashInferAttention

    ops, write = TORCH_OPS, None
    if _has_triton():
        from batchrun.kernels.triton_attention import write_kv
        from batchrun.layers.triton_ops import TritonOps

        ops, write = TritonOps(), write_kv
    try:
        return FlashInferAttention(device, write), ops
    except ImportError as e:  # installed but not importable (e.g. without apache-tvm-ffi)
        raise JobError(f"{FLASHINFER_NEEDS}: {e}".splitlines()[0]) from None

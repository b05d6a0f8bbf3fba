"""`--attention-backend auto`: the candidates, the choice of the fastest and its cache (on a CPU
with the measurement replaced), and the real measurement on a GPU with flashinfer (marked
`gpu`)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from batchrun.attention import choice
from batchrun.attention.base import AttentionBackend
from batchrun.attention.choice import Workload, fastest
from batchrun.attention.torch_backend import TorchAttention
from batchrun.engine.attention_backends import attention_backend, auto_candidates

WORKLOAD = Workload(32, 8, 128, "bfloat16", 16, 64, 16, 36, 5, 1024)


class Named(TorchAttention):
    def __init__(self, name: str) -> None:
        self.name = name


def test_candidates() -> None:
    assert auto_candidates(torch.device("cpu"), torch.bfloat16) == ("torch",)
    cuda = torch.device("cuda")
    assert auto_candidates(cuda, torch.float32) == ("triton",)  # flashinfer: half only
    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    assert auto_candidates(cuda, torch.bfloat16) == (
        ("triton", "flashinfer") if has_flashinfer else ("triton",)
    )


def test_the_fastest_is_chosen_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured once per GPU, packages and workload: a second job reads the cache; another
    workload measures again; an unreadable cache is measured over."""
    costs = {"triton": 2.0, "flashinfer": 1.5}
    measured: list[str] = []

    def step_ms(backend: AttentionBackend, workload: Workload, device: torch.device) -> float:
        measured.append(backend.name)
        return costs[backend.name] * workload.batch

    monkeypatch.setattr(choice, "step_ms", step_ms)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    makers = {name: lambda name=name: Named(name) for name in costs}
    cache = tmp_path / "cache" / "choice.json"
    device = torch.device("cpu")

    assert fastest(makers, WORKLOAD, device, cache) == (
        "flashinfer",
        {"triton": 128.0, "flashinfer": 96.0},
    )
    assert sorted(measured) == ["flashinfer", "triton"]
    costs["flashinfer"] = 3.0  # the cache answers: nothing is measured again
    assert fastest(makers, WORKLOAD, device, cache)[0] == "flashinfer"
    assert len(measured) == 2
    other = Workload(**{**WORKLOAD.__dict__, "batch": 8})
    assert fastest(makers, other, device, cache)[0] == "triton"
    assert len(measured) == 4
    assert len(json.loads(cache.read_text())) == 2
    cache.write_text("{not json")
    assert fastest(makers, WORKLOAD, device, cache)[0] == "triton"
    assert len(measured) == 6


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="no flashinfer")
def test_gpu_auto_measures_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU with flashinfer: `auto` times both backends at Qwen3-8B's attention shape and
    returns the faster, which builds and attends."""
    monkeypatch.setenv("BATCHRUN_CACHE", str(tmp_path))
    backend, _, ms = attention_backend("auto", torch.device("cuda"), WORKLOAD)
    assert ms is not None and set(ms) == {"triton", "flashinfer"}
    assert all(v > 0 for v in ms.values())
    assert backend.name == min(ms, key=lambda name: ms[name])
    print(f"auto at Qwen3-8B attention, batch 64, context 1024: {ms} -> {backend.name}")
    again = attention_backend("auto", torch.device("cuda"), WORKLOAD)
    assert again[0].name == backend.name and again[2] == ms  # from the cache

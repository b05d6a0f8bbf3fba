"""The Triton pass of the logit controls against the torch path, value for value.

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported) at a tiny vocabulary spanning several blocks; with CUDA on the GPU."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from batchrun.engine.core.requests import Request, RequestOutput  # noqa: E402
from batchrun.sampling import penalties, triton_penalties  # noqa: E402
from batchrun.sampling.control_state import ControlState  # noqa: E402
from batchrun.sampling.params import SamplingParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_is_the_torch_path(monkeypatch: pytest.MonkeyPatch, with_bias: bool) -> None:
    vocab = triton_penalties.BLOCK * 2 + 37 if DEVICE.type == "cuda" else 300
    monkeypatch.setattr(triton_penalties, "BLOCK", 128 if DEVICE.type == "cpu" else 2048)
    gen = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=-0.7),
        SamplingParams(min_tokens=9, stop_token_ids=(5, 250)),
        SamplingParams(repetition_penalty=0.8, min_tokens=2),
        SamplingParams(logit_bias=((3, 5.0), (299, -100.0)) if with_bias else ()),
        SamplingParams(),
    ]
    reqs = [
        Request(
            i,
            torch.randint(0, vocab, (40,), generator=gen).tolist(),
            p,
            output=RequestOutput(torch.randint(0, vocab, (30,), generator=gen).tolist()),
        )
        for i, p in enumerate(params)
    ]
    state = ControlState(len(reqs), vocab, DEVICE)
    state.eos_ids = frozenset({2})
    slots = torch.arange(len(reqs), device=DEVICE)
    state.admit(reqs, slots)
    row_slot = slots.repeat(3)
    steps = torch.tensor([0, 4, 30] * len(reqs), device=DEVICE).view(3, -1).T.reshape(-1)
    controls = state.rows(row_slot, steps)
    assert controls is not None
    logits = torch.randn(len(row_slot), vocab, generator=gen).to(DEVICE) * 4
    expected = logits.clone()
    with monkeypatch.context() as patch:
        patch.setattr(penalties, "_kernel", lambda logits: None)
        penalties.apply_controls(expected, controls)
    got = logits.clone()
    triton_penalties.apply_controls_triton(got, controls)
    assert torch.equal(got, expected)
    assert not torch.equal(got, logits)

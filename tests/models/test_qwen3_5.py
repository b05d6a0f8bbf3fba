"""Hybrid Gated DeltaNet targets (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, a Qwen3.5 with a vision
tower) on the CPU in float32: packed chunked prefill and decode equal transformers' logits; a
verify step's commit leaves the states of the kept tokens alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from batchrun.layers.linear_attention import LinearLayerState
from batchrun.layers.ops import TorchOps, use_ops
from batchrun.layers.triton_ops import TritonOps
from batchrun.models.loader import load_qwen3
from batchrun.models.qwen3_5 import Qwen3_5ForCausalLM
from tests.helpers.hybrid_models import KINDS, VOCAB, Stepper, make_hybrid

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, nn.Module]:
    out = tmp_path_factory.mktemp(request.param)
    return out, make_hybrid(out, request.param)


def loaded(path: Path) -> Qwen3_5ForCausalLM:
    model, _ = load_qwen3(path, "float32", CPU)
    assert isinstance(model, Qwen3_5ForCausalLM)
    return model


def reference_logits(reference: nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([tokens])).logits[0]


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (70, 9, 23)]


@torch.no_grad()
def test_chunked_prefill_then_decode_equals_transformers(
    checkpoint: tuple[Path, nn.Module],
) -> None:
    path, reference = checkpoint
    stepper = Stepper(loaded(path), slots=3)
    seqs = prompts()
    decoded = 5
    prompt_lens = [len(s) - decoded for s in seqs]
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    # Prefill in chunks of up to 20 rows, every request's chunk in the same step.
    done = [0, 0, 0]
    while any(d < n for d, n in zip(done, prompt_lens, strict=True)):
        items = []
        for r, seq in enumerate(seqs):
            if done[r] < prompt_lens[r]:
                end = min(done[r] + 20, prompt_lens[r])
                items.append((r, seq[done[r] : end], done[r]))
        logits, _ = stepper.step([], items)
        start = 0
        for r, tokens, _ in items:
            got[r].append(logits[start : start + len(tokens)])
            start += len(tokens)
            done[r] += len(tokens)
    for i in range(decoded):  # then token by token, every request decoding
        items = [(r, [seq[prompt_lens[r] + i]], prompt_lens[r] + i) for r, seq in enumerate(seqs)]
        logits, _ = stepper.step(items, [])
        for r in range(len(seqs)):
            got[r].append(logits[r : r + 1])
    for r, seq in enumerate(seqs):
        want = reference_logits(reference, seq)
        torch.testing.assert_close(torch.cat(got[r]), want, atol=1e-4, rtol=1e-4)


def linear_states(stepper: Stepper) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (c.conv.clone(), c.recurrent.clone())
        for c in stepper.caches
        if isinstance(c, LinearLayerState)
    ]


def assert_same_after_a_decode(verify: Stepper, kept: Stepper, lens: list[int]) -> None:
    """A verify's commit against a prefill of the kept rows alone (lens[r] tokens each): the
    next decode step of each (the verify's slots take their kept rows in it) has the same
    logits and leaves the same states, but for float32 rounding (the kept run reaches them
    through the chunked form)."""
    items = [(r, [r + 1], n) for r, n in enumerate(lens)]
    got, _ = verify.step(items, [])
    want, _ = kept.step(items, [])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for (c0, s0), (c1, s1) in zip(linear_states(verify), linear_states(kept), strict=True):
        torch.testing.assert_close(c0, c1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s0, s1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(3))
@torch.no_grad()
def test_a_verify_commit_keeps_exactly_the_accepted_rows(
    checkpoint: tuple[Path, nn.Module], seed: int
) -> None:
    path, reference = checkpoint
    model = loaded(path)
    width = 4
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (11, 6, 17)]
    drafts = [torch.randint(0, VOCAB, (width,), generator=gen).tolist() for _ in seqs]
    accepted = torch.tensor([0, width - 1, int(torch.randint(0, width, (1,), generator=gen))])

    verify = Stepper(model, slots=3, max_width=width)
    verify.step([], [(r, seq, 0) for r, seq in enumerate(seqs)])
    before = linear_states(verify)
    items = [(r, drafts[r], len(seq)) for r, seq in enumerate(seqs)]
    logits, meta = verify.step(items, [])
    after_forward = linear_states(verify)
    for (c0, s0), (c1, s1) in zip(before, after_forward, strict=True):
        assert torch.equal(c0, c1) and torch.equal(s0, s1), "a verify forward wrote a slot"
    # Every verify row's logits are the full sequence's.
    for r, seq in enumerate(seqs):
        want = reference_logits(reference, seq + drafts[r])[len(seq) :]
        torch.testing.assert_close(logits[r * width : (r + 1) * width], want, atol=1e-4, rtol=1e-4)
    verify.model.commit_linear(verify.caches, meta, accepted)

    kept = Stepper(model, slots=3, max_width=width)
    kept.step([], [(r, seq + drafts[r][: int(accepted[r]) + 1], 0) for r, seq in enumerate(seqs)])
    lens = [len(seq) + int(accepted[r]) + 1 for r, seq in enumerate(seqs)]
    assert_same_after_a_decode(verify, kept, lens)


@torch.no_grad()
def test_a_plain_decode_step_writes_its_slots_and_commit_does_nothing(
    checkpoint: tuple[Path, nn.Module],
) -> None:
    path, _ = checkpoint
    stepper = Stepper(loaded(path), slots=2)
    stepper.step([], [(0, [5, 6, 7], 0), (1, [8, 9], 0)])
    before = linear_states(stepper)
    _, meta = stepper.step([(0, [10], 3), (1, [11], 2)], [])
    after = linear_states(stepper)
    assert all(not torch.equal(a[1], b[1]) for a, b in zip(before, after, strict=True))
    stepper.model.commit_linear(stepper.caches, meta, torch.tensor([0, 0]))
    for (c0, s0), (c1, s1) in zip(after, linear_states(stepper), strict=True):
        assert torch.equal(c0, c1) and torch.equal(s0, s1)


@torch.no_grad()
@pytest.mark.parametrize("ops", [TorchOps, TritonOps])
def test_a_verify_of_rows_at_widths_of_their_own_keeps_each_rows_accepted(
    checkpoint: tuple[Path, nn.Module], ops: type[TorchOps], request: pytest.FixtureRequest
) -> None:
    """Rows verifying 1, 3 and 4 rows in one step, packed by offsets: each row's logits are its
    full sequence's, and after the commit each slot decodes as the accepted rows alone would. The
    fused kernels (Triton's interpreter off a GPU, for one kind: the layers are the same) run
    each request's own rows only."""
    path, reference = checkpoint
    if ops is TritonOps and request.node.callspec.params["checkpoint"] != KINDS[0]:
        pytest.skip("the fused kernels run on one kind (4 s each under the interpreter)")
    model = loaded(path)
    use_ops(model, ops())
    widths = (1, 3, 4)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 6, 13)]
    drafts = [torch.randint(0, VOCAB, (w,), generator=gen).tolist() for w in widths]
    accepted = torch.tensor([0, 2, 1])

    verify = Stepper(model, slots=3, max_width=max(widths))
    verify.step([], [(r, seq, 0) for r, seq in enumerate(seqs)])
    logits, meta = verify.step([(r, drafts[r], len(seq)) for r, seq in enumerate(seqs)], [])
    start = 0
    for r, seq in enumerate(seqs):
        want = reference_logits(reference, seq + drafts[r])[len(seq) :]
        got = logits[start : start + widths[r]]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        start += widths[r]
    verify.model.commit_linear(verify.caches, meta, accepted)

    kept = Stepper(model, slots=3, max_width=max(widths))
    kept.step([], [(r, seq + drafts[r][: int(accepted[r]) + 1], 0) for r, seq in enumerate(seqs)])
    lens = [len(seq) + int(accepted[r]) + 1 for r, seq in enumerate(seqs)]
    assert_same_after_a_decode(verify, kept, lens)


@torch.no_grad()
@pytest.mark.parametrize("ops", [TorchOps, TritonOps])
def test_verifies_in_a_row_take_each_ones_kept_rows_in_the_next(
    checkpoint: tuple[Path, nn.Module], ops: type[TorchOps], request: pytest.FixtureRequest
) -> None:
    """A verify right after a verify's commit: its slots take the first one's kept rows before
    its own (the lazy commit, ops.KeptRows), so its logits are the full sequences', and after
    its own commit each slot decodes as the rows both kept would."""
    path, reference = checkpoint
    if ops is TritonOps and request.node.callspec.params["checkpoint"] != KINDS[0]:
        pytest.skip("the fused kernels run on one kind (the layers are the same)")
    model = loaded(path)
    use_ops(model, ops())
    width = 3
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (7, 12)]
    verify = Stepper(model, slots=2, max_width=width)
    verify.step([], [(r, seq, 0) for r, seq in enumerate(seqs)])
    for accepted in (torch.tensor([1, 2]), torch.tensor([0, 1])):
        drafts = [torch.randint(0, VOCAB, (width,), generator=gen).tolist() for _ in seqs]
        logits, meta = verify.step([(r, drafts[r], len(seq)) for r, seq in enumerate(seqs)], [])
        for r, seq in enumerate(seqs):
            want = reference_logits(reference, seq + drafts[r])[len(seq) :]
            got = logits[r * width : (r + 1) * width]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        verify.model.commit_linear(verify.caches, meta, accepted)
        seqs = [seq + drafts[r][: int(accepted[r]) + 1] for r, seq in enumerate(seqs)]
    kept = Stepper(model, slots=2, max_width=width)
    kept.step([], [(r, seq, 0) for r, seq in enumerate(seqs)])
    assert_same_after_a_decode(verify, kept, [len(seq) for seq in seqs])

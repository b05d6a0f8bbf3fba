"""Tensor parallelism on the CPU: two gloo processes compute what one process does."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchrun.attention.meta import AttentionMeta, allocate_kv, cache_slots
from batchrun.attention.torch_backend import TorchAttention
from batchrun.errors import JobError
from batchrun.models.loader import load_qwen3, qwen3_shape, read_config
from batchrun.models.qwen3 import Qwen3ForCausalLM
from batchrun.parallel.group import TensorParallel, init_from_env
from batchrun.parallel.sharding import local_shape
from batchrun.parallel.vocab import first_best

CPU = torch.device("cpu")
PAGE_SIZE = 4
DECODE_STEPS = 3
# Token ids of prompts of different lengths, so requests straddle pages differently.
PROMPTS = [[5, 17, 300, 42, 9, 811, 64], [1000, 3], [77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 12]]

# Logits and greedy tokens of the rows of one paged forward: (logits [T, V], tokens [R]).
Head = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def paged_greedy(model: Qwen3ForCausalLM, head: Head) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill PROMPTS in one batch, then DECODE_STEPS batched greedy steps, through KV pages
    handed out in scrambled order. Returns each forward's logits (every row) and the tokens."""
    s = model.shape
    lengths = [len(p) + DECODE_STEPS for p in PROMPTS]
    pages_each = -(-max(lengths) // PAGE_SIZE)
    num_pages = len(PROMPTS) * pages_each
    page_table = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0))
    page_table = page_table.view(len(PROMPTS), pages_each).int()
    kv = allocate_kv(s.num_layers, num_pages, PAGE_SIZE, s.num_kv_heads, s.head_dim,
                     torch.float32, CPU)  # fmt: skip
    backend = TorchAttention()
    inputs, starts = [list(p) for p in PROMPTS], [0] * len(PROMPTS)
    all_logits, tokens = [], []
    for _ in range(DECODE_STEPS + 1):
        q_lens = torch.tensor([len(x) for x in inputs])
        ids = torch.tensor([t for x in inputs for t in x])
        req = torch.repeat_interleave(torch.arange(len(inputs)), q_lens)
        cu_q = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])
        positions = torch.tensor(starts)[req] + torch.arange(len(ids)) - cu_q[req]
        kv_lens = torch.tensor(starts) + q_lens
        backend.plan(AttentionMeta(
            positions=positions,
            slot_mapping=cache_slots(page_table, req, positions, PAGE_SIZE),
            cu_q=cu_q.int(), kv_lens=kv_lens.int(), page_table=page_table, page_size=PAGE_SIZE,
            max_q=int(q_lens.max()), max_kv=int(kv_lens.max()),
        ))  # fmt: skip
        with torch.no_grad():
            hidden, _ = model(ids, positions, backend, kv)
            logits, last_tokens = head(hidden)
        last_tokens = last_tokens[cu_q[1:] - 1]
        all_logits.append(logits)
        tokens.append(last_tokens)
        inputs, starts = [[int(t)] for t in last_tokens], kv_lens.tolist()
    return all_logits, torch.stack(tokens, 1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tp_rank(rank: int, world: int, port: int, model_dir: Path, out_dir: Path) -> None:
    """One torchrun-like process: joins the gloo group, loads its share, runs paged_greedy."""
    torch.set_num_threads(1)
    environ = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    tp = init_from_env(environ, device_type="cpu")
    model, _ = load_qwen3(model_dir, "float32", CPU, tp=tp)

    def head(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        local = model.logits(hidden)
        return model.full_logits(local), model.argmax(local)

    logits, tokens = paged_greedy(model, head)
    torch.save({"logits": logits, "tokens": tokens, "kv_heads": model.shape.num_kv_heads},
               out_dir / f"rank{rank}.pt")  # fmt: skip
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "shape",
    [{}, {"vocab_size": 1027, "tie_word_embeddings": False, "num_heads": 8, "num_kv_heads": 4}],
    ids=["tied", "untied-uneven-vocab"],
)
def test_two_gloo_ranks_match_one_process(
    make_model: Callable[..., Path], tmp_path: Path, shape: dict[str, object]
) -> None:
    model_dir = make_model(**shape)
    single, _ = load_qwen3(model_dir, "float32", CPU)

    def head(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = single.logits(hidden)
        return logits, logits.argmax(-1)

    want_logits, want_tokens = paged_greedy(single, head)
    mp.spawn(tp_rank, args=(2, free_port(), model_dir, tmp_path), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["kv_heads"] == single.shape.num_kv_heads // 2  # each rank pages half the heads
        assert torch.equal(got["tokens"], want_tokens)
        assert len(got["logits"]) == len(want_logits)
        for have, want in zip(got["logits"], want_logits, strict=True):
            assert have.shape == want.shape
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_first_best_breaks_ties_as_argmax(world: int) -> None:
    gen = torch.Generator().manual_seed(world)
    vocab = 23  # not a multiple of world: uneven slices
    logits = torch.randint(0, 4, (200, vocab), generator=gen).float()  # many ties
    logits[5, 7] = logits[6, 20] = float("nan")  # torch.argmax picks a NaN
    logits[7, 3] = logits[7, 15] = float("nan")  # the first NaN
    values, indices = [], []
    for rank in range(world):
        start, end = TensorParallel(rank, world, CPU).bounds(vocab)
        local = logits[:, start:end]
        index = local.argmax(-1)
        values.append(local.gather(-1, index.unsqueeze(-1)).squeeze(-1))
        indices.append(index + start)
    assert torch.equal(first_best(torch.stack(values), torch.stack(indices)), logits.argmax(-1))


def test_heads_that_do_not_split_are_refused(make_model: Callable[..., Path]) -> None:
    shape = qwen3_shape(read_config(make_model(num_heads=4, num_kv_heads=1)))
    with pytest.raises(JobError, match="does not divide the target's 1 KV heads"):
        local_shape(shape, TensorParallel(0, 2, CPU))


def test_init_outside_torchrun_is_refused() -> None:
    with pytest.raises(JobError, match="runs under torchrun: RANK"):
        init_from_env({}, device_type="cpu")

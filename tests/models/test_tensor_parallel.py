"""Tensor parallelism on the CPU: two gloo processes compute what one process does."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from click.testing import CliRunner

from batchrun.attention.meta import AttentionMeta, allocate_kv, kv_indices
from batchrun.attention.torch_backend import TorchAttention
from batchrun.bench.shapes import random_target, shape_from_flags
from batchrun.cli import cli
from batchrun.config.job import JobSpec, load_job
from batchrun.errors import JobError
from batchrun.io.output.directory import OutputDir
from batchrun.layers.fp8_linear import Fp8Linear
from batchrun.layers.parallel_logits import first_best
from batchrun.models.loader import load_qwen3, qwen3_shape, read_config
from batchrun.models.qwen3 import Qwen3ForCausalLM
from batchrun.models.qwen3_sharding import local_shape
from batchrun.parallel.group import TensorParallel, init_from_env
from batchrun.runners.local import run_job
from batchrun.runners.shard_env import apply_env_shard
from batchrun.spec_decode.width_policy import WidthPolicy
from batchrun.tools.tiny_draft import make_tiny_draft
from tests.helpers.dflash_train import CONTINUATION, trained_draft_beside, training_prompts
from tests.helpers.fp8_reference import quantize

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
    kv = allocate_kv(
        s.num_layers, num_pages, PAGE_SIZE, s.num_kv_heads, s.head_dim, torch.float32, CPU
    )
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
        backend.plan(
            AttentionMeta(
                positions=positions,
                kv_index=kv_indices(page_table, req, positions, PAGE_SIZE),
                cu_q=cu_q.int(),
                kv_lens=kv_lens.int(),
                page_table=page_table,
                page_size=PAGE_SIZE,
                max_q=int(q_lens.max()),
                max_kv=int(kv_lens.max()),
            )
        )
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


# The checkpoints the gloo ranks run: tied, and untied with 1027 ids (the ranks' vocabulary
# slices of unequal size) and 8 heads over 4 KV heads.
GLOO_SHAPES = {
    "tied": {},
    "untied-uneven-vocab": {
        "vocab_size": 1027,
        "tie_word_embeddings": False,
        "num_heads": 8,
        "num_kv_heads": 4,
    },
    # Qwen3-MoE: each rank holds half of every expert's rows, the router whole.
    "moe": {"num_layers": 3, "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": (1,)},
}
# FP8 checkpoints (32 x 32 blocks): every rank's share of each projection is whole blocks, so the
# ranks keep them in FP8, their scales split with them.
FP8_GLOO_SHAPES = {
    "fp8-moe": {
        "num_heads": 8,
        "num_kv_heads": 4,
        "num_layers": 3,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "mlp_only_layers": (1,),
        "moe_intermediate_size": 64,
    },
}


def shared_head(model: Qwen3ForCausalLM) -> Head:
    """A rank's head: the full logits and the argmax, each gathered across the ranks."""

    def head(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        local = model.logits(hidden)
        return model.full_logits(local), model.argmax(local)

    return head


def tp_rank(rank: int, world: int, port: int, model_dirs: dict[str, Path], out_dir: Path) -> None:
    """One torchrun-like process: joins the gloo group, then for each checkpoint loads its share
    and runs paged_greedy."""
    environ = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    tp = init_from_env(environ, device_type="cpu")
    for name, model_dir in model_dirs.items():
        model, _ = load_qwen3(model_dir, "float32", CPU, tp=tp)
        logits, tokens = paged_greedy(model, shared_head(model))
        fp8 = sum(isinstance(m, Fp8Linear) for m in model.modules())
        torch.save(
            {
                "logits": logits,
                "tokens": tokens,
                "kv_heads": model.shape.num_kv_heads,
                "fp8_layers": fp8,
            },
            out_dir / f"{name}-rank{rank}.pt",
        )
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("shape", [*GLOO_SHAPES, *FP8_GLOO_SHAPES])
def test_two_gloo_ranks_match_one_process(spawned_pair: SpawnedPair, shape: str) -> None:
    """tp_rank's results, run by spawned_pair's processes, against one process's."""
    single, _ = load_qwen3(spawned_pair.model_dirs[shape], "float32", CPU)

    def head(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = single.logits(hidden)
        return logits, logits.argmax(-1)

    want_logits, want_tokens = paged_greedy(single, head)
    for rank in range(2):
        got = spawned_pair.rank_result(shape, rank)
        assert got["kv_heads"] == single.shape.num_kv_heads // 2  # each rank pages half the heads
        fp8 = sum(isinstance(m, Fp8Linear) for m in single.modules())
        assert got["fp8_layers"] == fp8 and (fp8 > 0) == (shape in FP8_GLOO_SHAPES)
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


@pytest.mark.parametrize(
    ("name", "world", "kept"),
    [
        ("qwen3-8b", 2, True),
        ("qwen3-8b", 8, True),
        ("qwen3-30b-a3b", 2, True),
        ("qwen3-30b-a3b", 4, False),
    ],
)
def test_a_rank_keeps_fp8_where_its_shares_are_whole_blocks(
    name: str, world: int, kept: bool
) -> None:
    """128 x 128 blocks: Qwen3-8B's shares are whole blocks up to 8 ranks (8 KV heads of 128
    rows); Qwen3-30B-A3B's experts (768 rows) are 3 blocks a rank at 2, 1.5 at 4: dequantized."""
    shape = shape_from_flags(name, fp8_weights=True)
    local = local_shape(shape, TensorParallel(0, world, CPU))
    assert (local.fp8_block == (128, 128)) == kept and (local.fp8 is not None) == kept


def test_init_outside_torchrun_is_refused() -> None:
    with pytest.raises(JobError, match="runs under torchrun: RANK"):
        init_from_env({}, device_type="cpu")


# -- whole jobs -----------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
ONE_THREAD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
JOB_ROWS = 10
LOGPROB_COLUMNS = (
    "completion_logprobs",
    "completion_logprob_sum",
    "top_logprobs",
    "prompt_logprobs",
    "prompt_top_logprobs",
)


def write_tp_job(
    tmp_path: Path, model: Path, token_ids: list[list[int]] | None = None, **keys: object
) -> Path:
    """A job over JOB_ROWS text prompts of different lengths (one part per 4 rows), or over
    the prompts `token_ids`."""
    (tmp_path / "in").mkdir(exist_ok=True)
    prompts = [f"row {i} says" + " hello there" * (i % 4) for i in range(JOB_ROWS)]
    table = pa.table({"prompt": prompts} if token_ids is None else {"prompt_token_ids": token_ids})
    pq.write_table(table, tmp_path / "in" / "0.parquet")
    settings = {
        "max_tokens": 10,
        "rows_per_part": 4,
        "max_batch_size": 4,
        "device": "cpu",
        "quiet": True,
        **keys,
    }
    job = tmp_path / "job.toml"
    job.write_text(
        f'input = "in"\noutput = "out"\ntarget = "{model}"\n'
        + "".join(f"{key} = {json.dumps(value)}\n" for key, value in settings.items())
    )
    return job


def one_process(job: Path, output: Path) -> pa.Table:
    run_job(load_job(job, {"output": str(output)}))
    return read_output(output)


def run_tp(job: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`batchrun run JOB --tp 2 FLAGS` as a real process: it re-executes under torchrun."""
    return subprocess.run(
        [sys.executable, "-m", "batchrun.cli", "run", str(job), "--tp", "2", *flags],
        cwd=REPO,
        env=ONE_THREAD_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def read_output(out: Path) -> pa.Table:
    parts = sorted(out.glob("part-*.parquet"))
    return pa.concat_tables(pq.read_table(p) for p in parts).sort_by("row_index")


def assert_same_rows(got: pa.Table, want: pa.Table) -> None:
    """Every column equal; log-probabilities to float32 rounding (the ranks' partial sums are
    added in another order than one process adds them)."""
    assert got.schema == want.schema and got.num_rows == want.num_rows
    for name in want.column_names:
        if name in LOGPROB_COLUMNS:
            assert _close(got.column(name).to_pylist(), want.column(name).to_pylist()), name
        else:
            assert got.column(name).equals(want.column(name)), name


def _close(have: object, want: object) -> bool:
    """Nested lists and {token_id, logprob} dicts: ids equal, values within 1e-4."""
    if isinstance(want, dict) and isinstance(have, dict):
        return have.keys() == want.keys() and all(_close(have[k], want[k]) for k in want)
    if isinstance(want, list) and isinstance(have, list):
        return len(have) == len(want) and all(_close(h, w) for h, w in zip(have, want, strict=True))
    if isinstance(want, float) and isinstance(have, float):
        return abs(have - want) <= 1e-4 * max(1.0, abs(want))
    return have == want


STATS_COMPARED = (
    "rows",
    "ok_rows",
    "error_rows",
    "prompt_tokens",
    "completion_tokens",
    "spec_rounds",
    "acceptance_length",
    "per_position_acceptance",
    "verify_width_steps",
    "finish_reasons",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "keys",
    [
        # Greedy: every step takes the ranks' argmax (first_best), with or without log-probabilities
        # (they are scored from the gathered logits beside it), so one run checks both; the plain
        # greedy job is test_tp_job_resumes_the_rows_not_committed's.
        {"logprobs": 2, "prompt_logprobs": 3},
        {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 7, "n": 2},
    ],
    ids=["greedy-logprobs", "seeded-top-p-top-k"],
)
def test_tp_job_writes_what_one_process_writes(
    target: Path, tmp_path: Path, keys: dict[str, object]
) -> None:
    job = write_tp_job(tmp_path, target, **keys)
    want = one_process(job, tmp_path / "one")
    done = run_tp(job)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith(f"batchrun: {JOB_ROWS * int(keys.get('n', 1))}")
    assert_same_rows(read_output(tmp_path / "out"), want)
    assert (tmp_path / "out" / "_SUCCESS").exists()
    stats = [json.loads((tmp_path / d / "stats.json").read_text()) for d in ("out", "one")]
    assert [s["tensor_parallel"] for s in stats] == [2, 1]


@pytest.mark.slow
def test_tp_job_with_a_draft_drafts_what_one_process_drafts(target: Path, tmp_path: Path) -> None:
    """The trained draft on the prompts it learnt: it is accepted often, so drafts that were
    not one process's would change the acceptance (and ranks that drafted apart would verify
    different tokens)."""
    draft = trained_draft_beside(target)
    # A full-width verify every step: `auto` picks widths from step times, run by run.
    job = write_tp_job(
        tmp_path,
        target,
        training_prompts(seed=0),
        draft=str(draft),
        max_tokens=CONTINUATION,
        verify_width="full",
    )
    want = one_process(job, tmp_path / "one")
    done = run_tp(job)
    assert done.returncode == 0, done.stderr
    assert_same_rows(read_output(tmp_path / "out"), want)  # spec_accept_hist included
    stats = [json.loads((tmp_path / d / "stats.json").read_text()) for d in ("out", "one")]
    assert stats[1]["acceptance_length"] > 2
    assert {k: stats[0][k] for k in STATS_COMPARED} == {k: stats[1][k] for k in STATS_COMPARED}


@pytest.mark.slow
def test_tp_job_resumes_the_rows_not_committed(target: Path, tmp_path: Path) -> None:
    """Every rank reads the committed parts and skips the same rows (else they would not step
    in lockstep): the rows of a lost part are redone, the other parts kept as they are.

    The job is the plain greedy one (no log-probabilities, which
    test_tp_job_writes_what_one_process_writes asks for): the redone rows, the summary line,
    _SUCCESS and stats.json are the tensor-parallel run's."""
    job = write_tp_job(tmp_path, target)
    want = one_process(job, tmp_path / "out")
    one_stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    kept = {p.name: p.read_bytes() for p in parts[::2]}
    parts[1].unlink()
    (tmp_path / "out" / "_SUCCESS").unlink()
    done = run_tp(job)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith(f"batchrun: {JOB_ROWS} rows")
    assert all((tmp_path / "out" / name).read_bytes() == data for name, data in kept.items())
    assert_same_rows(read_output(tmp_path / "out"), want)
    assert (tmp_path / "out" / "_SUCCESS").exists()
    stats = [json.loads((tmp_path / "out" / "stats.json").read_text()), one_stats]
    assert [s["tensor_parallel"] for s in stats] == [2, 1]


def cli_rank(rank: int, port: int, job: Path, calls: Any) -> None:
    """A process of `torchrun --nproc-per-node 2 -m batchrun.cli run JOB --tp 2`: rank 1's
    output writes are recorded instead of done, and its own verify width would always be 1
    (ranks that verified different widths would not run the same collectives)."""
    torch.set_num_threads(1)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    if rank:
        for name in ("acquire", "prepare", "commit", "write_json", "mark_success"):
            setattr(OutputDir, name, lambda *_, name=name, **__: calls.append(name))
        WidthPolicy.choose = lambda *_, **__: 1  # type: ignore[method-assign]
    cli.main(["run", str(job), "--tp", "2"], standalone_mode=False)


def gloo_and_cli_ranks(
    rank: int,
    ports: tuple[int, int],
    model_dirs: dict[str, Path],
    out_dir: Path,
    job: Path,
    calls: Any,
) -> None:
    """A process of the one pair that the module spawns (spawned_pair; a process costs seconds
    to start on a small machine): tp_rank's gloo group, then, on a port of its own, cli_rank's
    whole job."""
    torch.set_num_threads(1)
    tp_rank(rank, 2, ports[0], model_dirs, out_dir)
    cli_rank(rank, ports[1], job, calls)


@dataclasses.dataclass
class SpawnedPair:
    """What spawned_pair's processes left in `root`: paged_greedy's results for each of
    `model_dirs`, the GLOO_SHAPES and FP8_GLOO_SHAPES checkpoints (`{shape}-rank{rank}.pt`),
    and cli_rank's job: its output `out`, beside `one`, one process's output of the same job;
    `calls`, the output writes rank 1 tried."""

    root: Path
    calls: list[str]
    model_dirs: dict[str, Path]

    def rank_result(self, shape: str, rank: int) -> dict[str, Any]:
        return dict(torch.load(self.root / f"{shape}-rank{rank}.pt"))


@pytest.fixture(scope="module")
def spawned_pair(
    make_model: Callable[..., Path], target: Path, tmp_path_factory: pytest.TempPathFactory
) -> SpawnedPair:
    """Spawns the module's one pair of processes (gloo_and_cli_ranks): the work of
    test_two_gloo_ranks_match_one_process and of test_tp_ranks_under_an_outer_torchrun_..."""
    root = tmp_path_factory.mktemp("spawned-pair")
    model_dirs = {name: make_model(**shape) for name, shape in GLOO_SHAPES.items()}
    for name, shape in FP8_GLOO_SHAPES.items():
        model_dirs[name] = quantize(make_model(**shape), root / name, [32, 32])
    draft = make_tiny_draft(root / "draft", target, block_size=4)
    job = write_tp_job(root, target, draft=str(draft), max_tokens=16)
    one_process(job, root / "one")
    ports = (free_port(), free_port())
    while ports[1] == ports[0]:
        ports = (ports[0], free_port())
    with mp.Manager() as manager:
        calls = manager.list()
        mp.spawn(
            gloo_and_cli_ranks, args=(ports, model_dirs, root, job, calls), nprocs=2, join=True
        )
        return SpawnedPair(root, list(calls), model_dirs)


@pytest.mark.slow
def test_tp_ranks_under_an_outer_torchrun_and_only_rank_0_writes(spawned_pair: SpawnedPair) -> None:
    """cli_rank's job (a tiny draft, 16 tokens), run by spawned_pair's processes."""
    root = spawned_pair.root
    assert spawned_pair.calls == []
    got, want = read_output(root / "out"), read_output(root / "one")
    assert_same_rows(
        got.drop(["spec_rounds", "spec_accept_hist", "acceptance_length"]),
        want.drop(["spec_rounds", "spec_accept_hist", "acceptance_length"]),
    )
    widths = json.loads((root / "out" / "stats.json").read_text())["verify_width_steps"]
    assert set(widths) - {"1"}  # rank 0's choices: not only rank 1's width 1
    one, out = (sorted(p.name for p in (root / d).rglob("*")) for d in ("one", "out"))
    assert out == one  # no shard: the files of one process's run


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tp", "3"], "tensor parallel size 3 does not divide the target's 4 attention heads"),
        (["--tp", "2", "--device", "cuda"], "tp 2 needs 2 GPUs (one per rank); this host has 0"),
        (["--tp", "2", "--device", "cuda:1"], "device 'cuda:1' with tp 2: use auto, cuda or cpu"),
    ],
)
def test_a_tp_job_that_cannot_start_says_why_in_one_line(
    target: Path, tmp_path: Path, flags: list[str], message: str
) -> None:
    if torch.cuda.is_available() and "cuda" in flags:
        pytest.skip("this host has GPUs")
    result = CliRunner().invoke(cli, ["run", str(write_tp_job(tmp_path, target)), *flags])
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"batchrun: error: {message}"), lines
    assert not (tmp_path / "out").exists()


def test_tp_groups_under_torchrun_are_data_parallel_shards() -> None:
    def shard(rank: int, world: int, tp: int) -> str | None:
        environ = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
        job = JobSpec.from_keys(dict(input="in", output="out", target="model", tp=tp))
        found = apply_env_shard(job, environ, io.StringIO(), cuda_devices=lambda: 4)
        # a TP rank joins its GPU
        assert found.engine.device == ("auto" if tp > 1 else f"cuda:{rank}")
        return found.run.shard

    assert [shard(r, 4, 2) for r in range(4)] == ["0/2", "0/2", "1/2", "1/2"]
    assert [shard(r, 2, 2) for r in range(2)] == [None, None]  # one group: the whole job
    assert [shard(r, 2, 1) for r in range(2)] == ["0/2", "1/2"]  # tp 1: as before
    with pytest.raises(JobError, match="WORLD_SIZE=3 is not a multiple of the tensor parallel"):
        shard(0, 3, 2)


# -- bench --shape --tp -----------------------------------------------------------------------

TINY_SHAPE = [
    "--shape",
    "qwen3-4b",
    "--num-layers",
    "6",
    "--hidden-size",
    "64",
    "--intermediate-size",
    "128",
    "--vocab-size",
    "1027",
]


def test_a_rank_builds_only_its_share_of_a_random_shape() -> None:
    shape = shape_from_flags(
        "qwen3-4b", num_layers=1, hidden_size=64, intermediate_size=128, vocab_size=1027
    )
    whole = random_target(shape, torch.float32, CPU)
    share = random_target(shape, torch.float32, CPU, TensorParallel(1, 2, CPU))
    assert share.lm_head.weight.shape == (1027 - 513, 64)  # rank 1's vocabulary slice
    params = {name: p.numel() for name, p in whole.named_parameters()}
    for name, p in share.named_parameters():
        if "embed_tokens" in name:  # tied with lm_head
            assert p.numel() == (1027 - 513) * 64
        else:  # norms whole; q/k/v, o, gate/up, down halved
            assert p.numel() == params[name] // (1 if "norm" in name else 2), name


@pytest.mark.slow
def test_bench_shape_sweeps_on_two_gloo_ranks(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchrun.cli",
            "bench",
            *TINY_SHAPE,
            "--device",
            "cpu",
            "--tp",
            "2",
            "--batch-sizes",
            "2",
            "--contexts",
            "16",
            "--steps",
            "2",
            "--no-hf-eager",
            "--hf-compiled-batches",
            "",
            "--no-cuda-graphs",
            "--out",
            str(out),
        ],
        cwd=REPO,
        env=ONE_THREAD_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count('"batch": 2') == 1  # rank 0 alone reports
    data = json.loads(out.read_text())
    assert data["setup"]["tensor_parallel"] == 2 and data["hf_generate"] == []
    modes = {(p["mode"], p["width"]) for p in data["points"]}
    assert modes == {("target_only", 1)} | {("dflash", w) for w in (1, 2, 4, 8, 16)}
    assert all(p["tokens_per_second"] > 0 for p in data["points"])

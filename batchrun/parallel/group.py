"""The tensor-parallel process group, from torchrun's environment.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in every process it starts;
each process joins one group over NCCL on CUDA (GPU LOCAL_RANK) or gloo on the CPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from batchrun.errors import JobError

TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def slice_bounds(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank's contiguous slice [start, end) of `size` rows split as evenly as can be (lower ranks
    hold lower rows)."""
    return size * rank // world_size, size * (rank + 1) // world_size


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    world_size: int
    device: torch.device

    def bounds(self, size: int) -> tuple[int, int]:
        return slice_bounds(size, self.rank, self.world_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, in place."""
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x of every rank, in rank order (same shape on every rank)."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return parts


def init_from_env(
    environ: Mapping[str, str] = os.environ, device_type: str | None = None
) -> TensorParallel:
    """Join (or reuse) the default process group of this torchrun process. device_type: "cuda"
    or "cpu" (None: cuda where there is one)."""
    missing = [key for key in TORCHRUN_KEYS if key not in environ]
    if missing:
        raise JobError(f"tensor parallelism runs under torchrun: {', '.join(missing)} not set")
    try:
        rank, world, local = (int(environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except ValueError:
        raise JobError("RANK, WORLD_SIZE and LOCAL_RANK must be integers") from None
    if not 0 <= rank < world:
        raise JobError(f"RANK={rank} is outside WORLD_SIZE={world}")
    kind = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(kind, local) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if kind == "cuda" else "gloo",
            init_method=f"tcp://{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}",
            rank=rank, world_size=world, device_id=device if kind == "cuda" else None,
        )  # fmt: skip
    return TensorParallel(rank, world, device)

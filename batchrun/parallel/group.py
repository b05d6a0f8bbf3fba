"""The tensor-parallel process group, from torchrun's environment.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in every process it starts;
each process joins one group over NCCL on CUDA (GPU LOCAL_RANK) or gloo on the CPU. Under a
torchrun of more processes than the tensor-parallel size, consecutive ranks form each tensor
parallel group (the groups are data-parallel shards of the job).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from batchrun.errors import JobError

TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
T = TypeVar("T")


def slice_bounds(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank's contiguous slice [start, end) of `size` rows split as evenly as can be (lower ranks
    hold lower rows)."""
    return size * rank // world_size, size * (rank + 1) // world_size


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group: rank of world_size. `group` carries
    the model's collectives (NCCL on GPUs; None: the default group), `control` the host's
    agreements between ranks (gloo, CPU tensors: no GPU sync)."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None = None
    control: dist.ProcessGroup | None = None

    def bounds(self, size: int) -> tuple[int, int]:
        return slice_bounds(size, self.rank, self.world_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x of every rank, in rank order (same shape on every rank)."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts

    def minimum(self, value: int) -> int:
        """The least of every rank's value (a memory-sized count all ranks must share)."""
        x = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.control)
        return int(x.item())

    def of_first(self, value: T) -> T:
        """Rank 0's value, on every rank (a choice that timings made, which ranks must share)."""
        box = [value]
        dist.broadcast_object_list(box, group=self.control, group_src=0)
        return cast(T, box[0])

    def first_int(self, value: int) -> int:
        """of_first for an int, without pickling (once a step)."""
        x = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(x, group=self.control, group_src=0)
        return int(x.item())

    def barrier(self) -> None:
        dist.barrier(group=self.control)


def init_from_env(
    environ: Mapping[str, str] = os.environ, device_type: str | None = None, size: int | None = None
) -> TensorParallel:
    """Join (or reuse) the default process group of this torchrun process and its tensor
    parallel group: ranks [g * size, (g + 1) * size) form group g (size None: every rank, one
    group). device_type: "cuda" or "cpu" (None: cuda where there is one)."""
    missing = [key for key in TORCHRUN_KEYS if key not in environ]
    if missing:
        raise JobError(f"tensor parallelism runs under torchrun: {', '.join(missing)} not set")
    try:
        rank, world, local = (int(environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except ValueError:
        raise JobError("RANK, WORLD_SIZE and LOCAL_RANK must be integers") from None
    if not 0 <= rank < world:
        raise JobError(f"RANK={rank} is outside WORLD_SIZE={world}")
    size = size or world
    if world % size:
        raise JobError(f"WORLD_SIZE={world} is not a multiple of the tensor parallel size {size}")
    kind = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and local >= torch.cuda.device_count():
        raise JobError(
            f"LOCAL_RANK={local} but this process sees {torch.cuda.device_count()} CUDA devices"
        )
    device = torch.device(kind, local) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if kind == "cuda" else "gloo",
            init_method=f"tcp://{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}",
            rank=rank,
            world_size=world,
            device_id=device if kind == "cuda" else None,
        )
    group, control = _groups(rank, world, size, gloo_default=kind != "cuda")
    return TensorParallel(rank % size, size, device, group, control)


def _groups(
    rank: int, world: int, size: int, gloo_default: bool
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's (model group, control group). Every rank creates every group, in the same
    order, as new_group requires; one group of every rank is the default group itself, and on
    the CPU (gloo) the control group is the model group."""
    mine: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None)
    for first in range(0, world, size):
        ranks = list(range(first, first + size))
        group = dist.new_group(ranks) if size < world else None
        control = group if gloo_default else dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            mine = (group, control)
    return mine

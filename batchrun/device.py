"""The device a job runs on, from its `device` setting, and copies between it and the host that
never wait: pinned staging on a GPU."""

from __future__ import annotations

import torch

from batchrun.errors import JobError


def resolve_device(name: str) -> torch.device:
    """auto, cpu, cuda or cuda:N; cuda:N also becomes the current CUDA device, so streams, graph
    pools and kernels launched without a device land on it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise JobError(f"device {name!r} was asked for but no CUDA device is available")
    device = torch.device(name)
    if device.index is not None:
        if device.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise JobError(f"device {name!r} was asked for but there are {count} CUDA devices")
        torch.cuda.set_device(device)
    return device


def put(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device: through pinned memory and asynchronous on a GPU."""
    return staged(host, device).to(device, non_blocking=True)


def to_host(values: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy on the host: on a GPU an asynchronous copy into pinned memory,
    complete once an event recorded after it has passed."""
    if values.device.type != "cuda":
        return values
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host


def staged(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tensor to copy to `device` from: pinned on a GPU (the caching host allocator keeps
    the block until the asynchronous copy has run)."""
    return host.pin_memory() if device.type == "cuda" else host

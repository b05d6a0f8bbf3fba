"""The device a job runs on, from its `device` setting."""

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

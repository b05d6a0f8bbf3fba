"""Models built as shapes only, for loaders and start-up checks that fill or inspect every
parameter themselves."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def _skip(module: nn.Module) -> None:
    """reset_parameters, skipped: every parameter is loaded (or drawn) afterwards."""


@contextmanager
def shapes_only() -> Iterator[None]:
    """Modules built inside hold their parameters on the meta device, uninitialised. Their
    default initialisation would be thrown away, and on the meta device its decompositions
    first import torch._dynamo: a second of every start-up."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = _skip  # type: ignore[method-assign,assignment]
    try:
        with torch.device("meta"):
            yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved  # type: ignore[method-assign]

"""What a speculation method provides, behind the registry (registry.py): the checks of a draft
against its target that read no weights (preflight), its loading, the layout of what it keeps
per page and per slot (memory sizing), the verify widths `auto` may choose among and the
speculator over a loaded draft. The engine, preflight and memory sizing see a method only
through this interface; what a method's checked draft holds (`spec`) is its own business."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from batchrun.attention.base import AttentionBackend
from batchrun.models.qwen3 import Qwen3ForCausalLM, Qwen3Shape
from batchrun.parallel.group import TensorParallel
from batchrun.spec_decode.base import Speculator, TargetView


@dataclass(frozen=True)
class DraftLayout:
    """What sizing and the attention choice need of a draft, whatever its method."""

    # Its layers' shape (heads, K/V heads, head dim); a drafter without layers: the target's.
    shape: Qwen3Shape
    block_size: int  # B: the rows a decoding request may verify in a step
    candidate_widths: tuple[int, ...]  # the verify widths `auto` chooses among
    feature_layers: int = 0  # target layers whose hidden states it reads, per row
    paged_layers: int = 0  # its layers whose K/V lives in caches indexed like the target's pages
    ring_layers: int = 0  # its layers whose K/V lives in a ring of its own per slot
    ring_positions: int = 0  # the positions one such ring holds (0: no rings)
    window: int | None = None  # the sliding window of its ring layers (None: none)

    def ring_pages(self, page_size: int) -> int:
        """Pages of one ring layer's ring per slot."""
        return -(-self.ring_positions // page_size)


@dataclass(frozen=True)
class DraftBackends:
    """The attention backends a draft attends with: the target's kind, and a second backend of
    that kind planned for the draft's sliding-window layers (None: no such layers)."""

    backend: AttentionBackend
    window_backend: AttentionBackend | None = None


class SpeculationMethod(Protocol):
    """One way of drafting and verifying, chosen by the draft's config.json (`architectures`)
    or named by the job (`speculative_method`). `spec` is what its `check` returned; a loaded
    draft is the module its `load` returned."""

    @property
    def name(self) -> str: ...  # the job key's value that names it
    @property
    def architectures(self) -> frozenset[str]: ...  # the config.json `architectures` it runs

    def check(self, draft_dir: Path, target: Qwen3Shape) -> Any:
        """Every check of the draft against its target that reads no weights: its config and
        tensor headers. Raises JobError."""
        ...

    def check_weights(
        self, draft_dir: Path, spec: Any, target: Qwen3Shape, dtype: torch.dtype
    ) -> int:
        """The loader's checks of the weights' names and shapes, from the headers alone.
        Returns the bytes its weights take in `dtype`. Raises JobError."""
        ...

    def describe(self, spec: Any) -> str:
        """What `batchrun validate` says of the draft (after its path)."""
        ...

    def layout(self, draft: Any) -> DraftLayout:
        """The layout of a checked spec or of a loaded draft."""
        ...

    def load(
        self, draft_dir: Path, target: Qwen3ForCausalLM, device: torch.device, max_positions: int
    ) -> nn.Module:
        """The draft on `device`, for a target of positions up to max_positions."""
        ...

    def owns(self, draft: nn.Module) -> bool:
        """Whether a loaded draft is one of this method's."""
        ...

    def make(
        self,
        target: TargetView,
        draft: nn.Module,
        backends: DraftBackends,
        *,
        widths: tuple[int, ...],
        max_batch_size: int,
        tp: TensorParallel | None,
    ) -> Speculator:
        """The speculator over `target` with this loaded draft; widths: the verify widths it
        may choose (spec_decode/verify_widths.py)."""
        ...


@dataclass(frozen=True)
class CheckedDraft:
    """A draft checked against its target (preflight), with the method that runs it."""

    method: SpeculationMethod
    directory: Path
    spec: Any  # the method's own description, which its other calls read
    layout: DraftLayout

    def describe(self) -> str:
        return self.method.describe(self.spec)

"""How a DFlash draft's block rows attend, layer by layer: the draft model's description of its
attention, read from its config (models/dflash_formats.py) and used by its forward and by the
speculator that plans its metadata (spec_decode/dflash/)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockAttention:
    """How each layer of a DFlash draft attends from its block rows: full-attention layers see
    the whole context, sliding layers only positions within `window` of the row; each group is
    either non-causal inside the block (every row sees every block row) or causal."""

    sliding: tuple[bool, ...]  # per draft layer
    window: int | None = None  # W, for the sliding layers
    full_causal: bool = False
    sliding_causal: bool = False

    def __post_init__(self) -> None:
        if any(self.sliding) and not (isinstance(self.window, int) and self.window >= 1):
            raise ValueError(f"sliding layers need a window >= 1, got {self.window!r}")

    @classmethod
    def full(cls, num_layers: int) -> BlockAttention:
        """Every layer full attention, non-causal: the z-lab DFlash drafts."""
        return cls((False,) * num_layers)

    @property
    def num_full(self) -> int:
        return len(self.sliding) - sum(self.sliding)

    @property
    def num_sliding(self) -> int:
        return sum(self.sliding)

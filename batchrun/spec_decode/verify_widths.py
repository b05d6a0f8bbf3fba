"""The verify widths a job's engine may pick (its CUDA graphs are captured for each), from the
`verify_width` setting and the draft's layout, whatever its method."""

from __future__ import annotations

from batchrun.errors import JobError
from batchrun.spec_decode.method import DraftLayout


def verify_widths(verify_width: int | str, draft: DraftLayout | None) -> tuple[int, ...]:
    """Every candidate of the draft's method under `auto`, the block under `full`, else the one
    asked for; (1,) without a draft."""
    if draft is None:
        return (1,)
    block_size = draft.block_size
    if verify_width == "auto":
        return draft.candidate_widths
    if verify_width == "full":
        return (block_size,)
    if not (isinstance(verify_width, int) and 1 <= verify_width <= block_size):
        raise JobError(
            f"verify width must be auto, full or 1 .. {block_size} (the draft's block size), "
            f"got {verify_width!r}"
        )
    return (verify_width,)

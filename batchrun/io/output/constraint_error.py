"""A finished row checked against its constraint: the error of a `stop` row whose completion
does not satisfy it in full, said beside the completion, which is kept.

Only `stop` rows are checked: a `length` row was cut by max_tokens and is incomplete by design.
A `stop` row's grammar let it end only where its constraint was met, so a completion that breaks
it was cut by one of the row's stop conditions that the grammar does not see: a stop token id
the grammar took as text (the last output id), else a stop string (the text is cut at it).
"""

from __future__ import annotations

from batchrun.engine.core.requests import Request
from batchrun.sampling.constraint_check import violation


def constraint_error(request: Request, completion: str | None) -> str | None:
    """Why the row's completion (with a reasoning parser, the answer after its think block)
    breaks its constraint, or None: it holds, the row has none, or the row is not `stop`."""
    constraint = request.params.constraint
    out = request.output
    if constraint is None or out.finish_reason != "stop" or out.completion is None:
        return None  # (no text without a tokenizer: engines built for benchmarks)
    detail = (
        "the row ended inside its think block, before any answer"
        if completion is None
        else violation(constraint, completion)
    )
    if detail is None:
        return None
    kind, ids = constraint.kind, out.token_ids
    if ids and ids[-1] in request.params.stop_token_ids:
        return f"stop token id {ids[-1]} cut the completion before its {kind} was met: {detail}"
    if request.params.stop:
        return f"a stop string cut the completion before its {kind} was met: {detail}"
    return f"the completion breaks its {kind}: {detail}"

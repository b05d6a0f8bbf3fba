"""The JobError inside an error that Ray raises for a remote task or actor."""

from __future__ import annotations

from batchrun.errors import JobError


def job_error(exc: BaseException) -> JobError | None:
    """The JobError a Ray error wraps (a remote task's or actor's), if any."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, JobError):
            return JobError(str(current))
        todo += [current.__cause__, current.__context__, getattr(current, "cause", None)]
    return None

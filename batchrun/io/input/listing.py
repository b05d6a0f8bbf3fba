"""The input files an object-store --input names, found as local ones are
(batchrun.io.input.reader): an object, a prefix (every *.parquet below it, none under a name
starting with '.' or '_', none of a batchrun output found below it) or a glob ('*', '?', '[...]'
within one name, '**' across any number of them), sorted by path, never the output's own
objects."""

from __future__ import annotations

import glob
from fnmatch import fnmatchcase
from pathlib import PurePath, PurePosixPath

from batchrun.errors import JobError
from batchrun.io.parts import PART_PATTERN, PROGRESS_DIR
from batchrun.io.store import ObjectLocation, Store, is_uri


def list_object_inputs(store: Store, spec: str, exclude: str | None) -> list[PurePath]:
    """The files of an object-store input spec; JobError (one line) when there are none or the
    store cannot be read."""
    location = ObjectLocation.parse(spec)
    root = PurePosixPath(location.path)
    excluded = _excluded(location, exclude)

    def outside(path: PurePath) -> bool:
        return excluded is None or not path.is_relative_to(excluded)

    try:
        if store.kind(PurePosixPath(location.bucket)) != "dir":
            raise JobError(f"input {spec!r}: bucket {location.bucket!r} does not exist")
        if glob.has_magic(location.path):
            found = [p for p in _glob(store, root) if outside(p)]
            if not found:
                raise JobError(f"input glob {spec!r} matches no files")
            return found
        kind = store.kind(root)
        if kind == "file":
            if not outside(root):
                raise JobError(f"input file {spec!r} is inside the output directory {exclude!r}")
            return [root]
        if kind == "dir":
            found = [p for p in _parquet_below(store, root) if outside(p)]
            if not found:
                raise JobError(f"input directory {spec!r} holds no .parquet files")
            return found
    except OSError as exc:
        raise JobError(f"cannot read input {spec!r}: {exc}") from None
    raise JobError(f"input {spec!r} does not exist")


def _excluded(location: ObjectLocation, exclude: str | None) -> PurePosixPath | None:
    """The output's prefix, when it is in the same store as the input."""
    if exclude is None or not is_uri(exclude):
        return None
    output = ObjectLocation.parse(exclude)
    return PurePosixPath(output.path) if output.scheme == location.scheme else None


def _glob(store: Store, pattern: PurePosixPath) -> list[PurePath]:
    parts = pattern.parts
    fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    base = PurePosixPath(*parts[:fixed])
    return [
        path
        for path in store.glob(base, "*", recursive=True)
        if _matches(parts[fixed:], path.relative_to(base).parts)
    ]


def _matches(pattern: tuple[str, ...], names: tuple[str, ...]) -> bool:
    """Whether a path's names match a glob's, name by name; '**' matches any number of names."""
    if not pattern:
        return not names
    if pattern[0] == "**":
        return any(_matches(pattern[1:], names[skip:]) for skip in range(len(names) + 1))
    return bool(names) and fnmatchcase(names[0], pattern[0]) and _matches(pattern[1:], names[1:])


def _parquet_below(store: Store, root: PurePosixPath) -> list[PurePath]:
    outputs: dict[PurePath, bool] = {}  # a directory below root: is it a batchrun output?

    def in_nested_output(path: PurePath) -> bool:
        parent = path.parent
        if parent == root or not fnmatchcase(path.name, PART_PATTERN):
            return False
        if parent not in outputs:
            outputs[parent] = store.kind(parent / PROGRESS_DIR) == "dir"
        return outputs[parent]

    return [
        path
        for path in store.glob(root, "*.parquet", recursive=True)
        if not any(name.startswith((".", "_")) for name in path.relative_to(root).parts)
        and not in_nested_output(path)
    ]

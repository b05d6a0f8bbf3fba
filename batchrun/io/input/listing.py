"""The input files --input names, listed once for every store (batchrun.io.store: a local
filesystem or an object store): a file, a directory or prefix (every *.parquet below it, none
under a name starting with '.' or '_', none of a batchrun output found below it) or a glob ('*',
'?', '[...]' within one name, '**' across any number of them), sorted by path, never the output's
own files."""

from __future__ import annotations

import glob
from fnmatch import fnmatchcase
from pathlib import PurePath

from batchrun.errors import JobError
from batchrun.io.parts import PART_PATTERN, PROGRESS_DIR
from batchrun.io.store import Store, store_for


def input_paths(spec: str, exclude: str | PurePath | None = None) -> tuple[Store, list[PurePath]]:
    """The store of --input and the files it names, sorted by path (exclude: the output, a
    local path or an object-store URI, never read as input); JobError (one line) when there are
    none or the store cannot be read."""
    store = store_for(spec)
    return store, _list(store, spec, exclude)


def resolve_input_paths(spec: str, exclude: str | PurePath | None = None) -> list[PurePath]:
    """The files --input names (input_paths without the store)."""
    return input_paths(spec, exclude)[1]


def _list(store: Store, spec: str, exclude: str | PurePath | None) -> list[PurePath]:
    root = store.path(spec)
    excluded = (
        store.path(str(exclude)) if exclude is not None and store.holds(str(exclude)) else None
    )
    inside = (lambda path: False) if excluded is None else store.under(excluded)
    try:
        absent = store.absent_root(root)
        if absent is not None:
            raise JobError(f"input {spec!r}: {absent}")
        kind = store.kind(root)
        shown = store.shown(excluded) if excluded is not None else ""
        if kind in ("file", "dir") and inside(root):  # every file it names would be the output's
            assert excluded is not None
            what = f"input {'file' if kind == 'file' else 'directory'} {spec!r}"
            if kind == "dir" and store.under(root)(excluded):
                raise JobError(f"{what} is the output directory: write the output elsewhere")
            raise JobError(f"{what} is inside the output directory {shown!r}")
        if kind == "file":
            return [root]
        if kind == "dir":
            found = [p for p in _parquet_below(store, root) if not inside(p)]
            if not found:
                raise JobError(f"input directory {spec!r} holds no .parquet files")
            return found
        if glob.has_magic(spec):
            matched = store.match(root)
            found = [p for p in matched if not inside(p)]
            if matched and not found:
                raise JobError(
                    f"input glob {spec!r} matches only files inside the output directory {shown!r}"
                )
            if not found:
                raise JobError(f"input glob {spec!r} matches no files")
            return found
    except OSError as exc:
        raise JobError(f"cannot read input {spec!r}: {exc}") from None
    raise JobError(f"input {spec!r} does not exist")


def _parquet_below(store: Store, root: PurePath) -> list[PurePath]:
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

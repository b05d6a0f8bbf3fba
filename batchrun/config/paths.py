"""The job's path keys: relative ones in a job file resolve against its directory, and every
one is checked for what the system cannot look up before anything opens it. An object-store URI
(s3://, gs://: input and output only) is left as written; model directories stay local."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

from batchrun.errors import JobError
from batchrun.io.store import is_uri

# Keys holding paths: relative ones in a job file resolve against the job file's directory.
PATH_KEYS = ("input", "output", "target", "draft", "metrics_file", "claims_dir")
URI_KEYS = ("input", "output")  # keys that may name object storage (batchrun.io.store)


def resolve_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """A job file's keys with its relative paths resolved against `base` (in place)."""
    for key in PATH_KEYS:
        value = data.get(key)
        if isinstance(value, str) and key in URI_KEYS and is_uri(value):
            continue
        if isinstance(value, str) and not (key == "draft" and value.lower() == "none"):
            # An absolute value replaces base; normpath keeps globs intact (no resolve()).
            data[key] = os.path.normpath(base / value)
    return data


def check_path(key: str, path: str) -> None:
    """JobError, naming the job key, for a path the system cannot look up (OSError: a name or
    the whole path too long, a directory on the way that cannot be searched, a symlink loop)
    or could not create: a name, past the part that exists, longer than its filesystem allows.
    A path that does not exist yet passes; what else is wrong with it is for its own checks.
    Glob patterns pass the name-length check: a long pattern can match a short name.
    An object-store URI of input or output passes (its store checks it when it opens); one
    elsewhere is refused: models load from local files."""
    if is_uri(path):
        if key in URI_KEYS:
            return
        raise JobError(f"{key} {path!r}: only input and output may be in object storage")
    try:
        os.stat(path)
        return
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as exc:
        raise JobError(f"{key} path {_shown(path)}: {exc.strerror or exc}") from None
    absolute = os.path.abspath(path)
    existing = os.path.dirname(absolute)
    while not os.path.isdir(existing) and existing != os.path.dirname(existing):
        existing = os.path.dirname(existing)
    name_max = _pathconf(existing, "PC_NAME_MAX", 255)
    path_max = _pathconf(existing, "PC_PATH_MAX", 4096)
    for name in Path(os.path.relpath(absolute, existing)).parts:
        size = len(os.fsencode(name))
        if size > name_max and not glob.has_magic(name):
            raise JobError(
                f"{key} path {_shown(path)}: a name of {size} bytes is longer than the "
                f"{name_max} its filesystem allows"
            )
    size = len(os.fsencode(absolute))
    if size >= path_max:
        raise JobError(
            f"{key} path {_shown(path)}: its absolute path is {size} bytes, more than the "
            f"{path_max - 1} the system allows"
        )


def _pathconf(path: str, name: str, default: int) -> int:
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):  # no such limit here, or none the system names
        return default


def _shown(path: str) -> str:
    """The path for an error line: a long one cut in the middle, with its length."""
    if len(path) <= 80:
        return repr(path)
    return f"{path[:40] + '...' + path[-30:]!r} ({len(path)} characters)"

"""The output directory and what is committed in it, so a re-run does each input row exactly once.

The part files are the truth. After a part is renamed into place, a manifest with its row
indices goes to _progress/; a kill between the two leaves a part without a manifest, which the
next start rebuilds from the part's row_index column. A kill during a part write leaves only a
temp file, which the next start deletes. Rows listed by a manifest whose part exists are done.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.errors import JobError
from batchrun.io.parts import PART_PATTERN, PartNames, is_temp, write_part, write_text_atomically
from batchrun.io.reader import InputSource

if TYPE_CHECKING:
    from batchrun.job import JobSpec

PROGRESS_DIR = "_progress"
JOB_FILE = "job.json"
SUCCESS_FILE = "_SUCCESS"
STATS_FILE = "stats.json"


def job_fingerprint(job: JobSpec, source: InputSource) -> dict[str, Any]:
    """What makes two runs the same job: the same outputs may be mixed in one directory."""
    params = job.default_params()
    return {
        "input": [[str(f.path.resolve()), f.num_rows] for f in source.files],
        "target": str(Path(job.target).resolve()),
        "draft": str(Path(job.draft).resolve()) if job.draft is not None else None,
        "sampling": {
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "seed": params.seed,
            "stop": list(params.stop),
            "stop_token_ids": list(params.stop_token_ids),
        },
    }


def row_ranges(indices: np.ndarray) -> list[list[int]]:
    """Sorted [start, stop) ranges covering the given distinct row indices."""
    if len(indices) == 0:
        return []
    rows = np.sort(indices)
    breaks = np.nonzero(np.diff(rows) != 1)[0]
    starts = np.concatenate([rows[:1], rows[breaks + 1]])
    stops = np.concatenate([rows[breaks] + 1, rows[-1:] + 1])
    return [[int(start), int(stop)] for start, stop in zip(starts, stops, strict=True)]


def _part_rows(part: Path) -> np.ndarray:
    """The row indices a committed part holds, read from the part itself."""
    return pq.read_table(part, columns=["row_index"]).column("row_index").to_numpy()


class OutputDir:
    """One shard's (or the whole job's) view of the output directory."""

    def __init__(self, path: Path, shard: tuple[int, int] | None = None) -> None:
        self.path = path
        self.progress = path / PROGRESS_DIR
        self.names = PartNames(shard)
        self._next_number: int | None = None  # of this shard's next part, found on first commit

    # -- start-up ---------------------------------------------------------------------------

    def check(self, fingerprint: dict[str, Any], overwrite: bool) -> None:
        """Raise JobError if the directory cannot take this job's output. Writes nothing."""
        if self.path.exists() and not self.path.is_dir():
            raise JobError(f"output {str(self.path)!r} exists and is not a directory")
        existing = self.path
        while not existing.exists():
            existing = existing.parent
        if not os.access(existing, os.W_OK | os.X_OK):
            raise JobError(f"output {str(self.path)!r} is not writable")
        if overwrite or not self.all_parts():
            return
        recorded = self._recorded_fingerprint()
        if recorded is None:
            raise JobError(
                f"output {str(self.path)!r} holds part files but no {PROGRESS_DIR}/{JOB_FILE}; "
                "use --overwrite or another --output"
            )
        if recorded != fingerprint:
            differs = next(key for key in fingerprint if recorded.get(key) != fingerprint[key])
            raise JobError(
                f"output {str(self.path)!r} holds parts of a different job ({differs} differs); "
                "use --overwrite or another --output"
            )

    def prepare(self, fingerprint: dict[str, Any], overwrite: bool) -> None:
        """Clear (with overwrite) or recover after a kill, and record the job."""
        if overwrite:
            self._clear()
        self._next_number = None
        self.progress.mkdir(parents=True, exist_ok=True)
        write_text_atomically(self.progress / JOB_FILE, json.dumps(fingerprint, indent=2) + "\n")
        for directory in (self.path, self.progress):
            for entry in directory.iterdir():
                if self._is_our_temp(entry.name):
                    entry.unlink(missing_ok=True)
        for part in self.all_parts():
            if not self._manifest_path(part).exists():
                self._write_manifest(part, _part_rows(part))

    def _is_our_temp(self, name: str) -> bool:
        # Temps of a shard's parts, manifests and stats carry its tag; unsharded owns them all.
        return is_temp(name) and (self.names.shard is None or self.names.tag in name)

    def _clear(self) -> None:
        if self.names.shard is None:
            (self.progress / JOB_FILE).unlink(missing_ok=True)  # an interrupted clear cannot resume
            shutil.rmtree(self.progress, ignore_errors=True)
            doomed = [*self.all_parts(), self.path / STATS_FILE]
        else:
            doomed = [p for p in self.all_parts() if self.names.number(p.name) is not None]
            doomed += [self._manifest_path(p) for p in doomed] + [self.stats_path]
        for path in [self.path / SUCCESS_FILE, *doomed]:
            path.unlink(missing_ok=True)

    def _recorded_fingerprint(self) -> dict[str, Any] | None:
        try:
            recorded: dict[str, Any] = json.loads((self.progress / JOB_FILE).read_text())
        except (OSError, ValueError):
            return None
        return recorded

    # -- committed rows ---------------------------------------------------------------------

    def all_parts(self) -> list[Path]:
        """Every shard's committed parts, sorted by name."""
        if not self.path.is_dir():
            return []
        return sorted(self.path.glob(PART_PATTERN))

    def own_parts(self) -> list[Path]:
        return [p for p in self.all_parts() if self.names.number(p.name) is not None]

    def done_mask(self, total_rows: int) -> np.ndarray:
        """True for each row_index with a committed output row (by any shard)."""
        done = np.zeros(total_rows, dtype=bool)
        for part in self.all_parts():
            manifest = self._read_manifest(part)
            for start, stop in manifest["row_ranges"]:
                done[start:stop] = True
        return done

    def commit(self, table: pa.Table) -> Path:
        """Write the next part atomically, then its manifest."""
        if self._next_number is None:
            numbers = [self.names.number(p.name) for p in self.own_parts()]
            self._next_number = max((n for n in numbers if n is not None), default=-1) + 1
        path = self.path / self.names.name(self._next_number)
        write_part(path, table)
        self._next_number += 1
        self._write_manifest(path, table.column("row_index").to_numpy())
        return path

    def _manifest_path(self, part: Path) -> Path:
        return self.progress / f"{part.stem}.json"

    def _write_manifest(self, part: Path, indices: np.ndarray) -> None:
        manifest = {"part": part.name, "rows": len(indices), "row_ranges": row_ranges(indices)}
        write_text_atomically(self._manifest_path(part), json.dumps(manifest) + "\n")

    def _read_manifest(self, part: Path) -> dict[str, Any]:
        path = self._manifest_path(part)
        try:
            manifest: dict[str, Any] = json.loads(path.read_text())
        except FileNotFoundError:
            # Another shard's part between its rename and its manifest: read the part itself.
            return {"row_ranges": row_ranges(_part_rows(part))}
        return manifest

    # -- stats and completion ---------------------------------------------------------------

    @property
    def stats_path(self) -> Path:
        """stats.json, or with a shard its own file in _progress/ (stats.json is job-wide)."""
        if self.names.shard is None:
            return self.path / STATS_FILE
        return self.progress / f"stats-{self.names.tag}.json"

    def shard_stats_paths(self) -> list[Path]:
        return sorted(self.progress.glob("stats-*.json"))

    def read_json(self, path: Path) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(path.read_text())
        return data

    def write_json(self, path: Path, data: dict[str, Any]) -> None:
        write_text_atomically(path, json.dumps(data, indent=2) + "\n")

    def mark_success(self) -> None:
        write_text_atomically(self.path / SUCCESS_FILE, "")

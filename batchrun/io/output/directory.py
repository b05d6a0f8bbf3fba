"""The output directory and what is committed in it, so a re-run does each input row exactly once.

The part files are the truth. After a part is renamed into place, a manifest with its row
indices goes to _progress/; a kill between the two leaves a part without a manifest, which the
next start rebuilds from the part's row_index column. A kill during a part write leaves only a
temp file, which the next start deletes. A part whose footer cannot be read (truncated, damaged)
is moved to _progress/damaged/ by the next start, and its rows are redone.

Every part carries its job's hash (batchrun.io.output.fingerprint) in its Parquet metadata: a
row is done when a readable part of this job holds it, and a part without that key was not
written by batchrun. Writes happen only under the run's claim (batchrun.io.output.claim),
checked before every part commit and before _SUCCESS.

Nothing in the directory is trusted: a manifest batchrun could not have written (wrong types) is
treated as absent, and a run refuses a directory where it would write, replace or delete through
a symlink (_progress, _claims or a file of its own being one; OUT itself may be one).

OUT may also be an object-store prefix (s3://bucket/key, batchrun.io.store): there each file is
written once, whole, under its final name (an upload appears only when complete, so there are no
temps), parts before their manifests, stats.json and _SUCCESS last. An s3:// output keeps its
claims in the bucket (OUT/_claims/, through S3's conditional writes: bucket_claims.py) unless
claims_dir names a local or shared directory for them; other object stores need claims_dir.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

import numpy as np
import pyarrow as pa

from batchrun.errors import JobError
from batchrun.io.local_paths import unmakeable
from batchrun.io.output.bucket_claims import CLAIMS_IN_BUCKET, BucketClaims, require_boto3
from batchrun.io.output.claim import CLAIMS_DIR, Claim, acquire
from batchrun.io.output.claim_space import ClaimSpace, DirectoryClaims
from batchrun.io.output.fingerprint import first_difference, job_hash
from batchrun.io.output.stats import Timing
from batchrun.io.parts import (
    PART_PATTERN,
    PROGRESS_DIR,
    STATS_FILE,
    SUCCESS_FILE,
    PartNames,
    is_output_file,
    is_temp,
    refuse_symlink,
)
from batchrun.io.store import LOCAL, ObjectLocation, Store, storage_reason, store_for

DAMAGED_DIR = "damaged"  # in _progress/
CHUNKS_DIR = "chunks"  # in _claims/: the chunk claims of a multi-worker job's workers
JOB_FILE = "job.json"
MAX_TIME = 1e11  # seconds since the epoch (year 5138): later manifest times are not real ones
JOB_KEY = b"batchrun.job"  # a part's Parquet metadata key holding its job's hash


def row_ranges(indices: np.ndarray) -> list[list[int]]:
    """Sorted [start, stop) ranges covering the given row indices (a row's n samples repeat
    its index)."""
    if len(indices) == 0:
        return []
    rows = np.unique(indices)
    breaks = np.nonzero(np.diff(rows) != 1)[0]
    starts = np.concatenate([rows[:1], rows[breaks + 1]])
    stops = np.concatenate([rows[breaks] + 1, rows[-1:] + 1])
    return [[int(start), int(stop)] for start, stop in zip(starts, stops, strict=True)]


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


@dataclass(frozen=True)
class _Footer:
    """What a part's footer says: its row count and job, or why it cannot be read."""

    rows: int
    job: str | None  # None: no batchrun job key, so not a part batchrun wrote
    damage: str | None  # None: readable
    present: bool = True  # False: gone since it was listed (another shard's overwrite)


def _read_footer(store: Store, part: PurePath) -> _Footer:
    try:
        metadata = store.read_metadata(part)
        schema = metadata.schema.to_arrow_schema()
    except FileNotFoundError:
        return _Footer(0, None, None, present=False)
    except (OSError, pa.ArrowException) as exc:
        if not store.local and isinstance(exc, OSError):  # the store, not the part, failed
            why = storage_reason(exc, ObjectLocation.parse(store.shown(part)))
            raise JobError(f"cannot read {store.shown(part)!r}: {why}") from None
        return _Footer(0, None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    key = (metadata.metadata or {}).get(JOB_KEY)
    job = key.decode(errors="replace") if key is not None else None
    # A part with a job key but no row_index to mark its rows done is no part of that job.
    if job and [field.type for field in schema if field.name == "row_index"] != [pa.int64()]:
        return _Footer(0, job, "no int64 row_index column")
    return _Footer(metadata.num_rows, job, None)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_time(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < MAX_TIME


def _valid_manifest(data: Any, part: PurePath) -> dict[str, Any] | None:
    """The manifest if batchrun could have written it for `part`, else None (as if absent: its
    rows are read from the part, its times from the file)."""
    if not isinstance(data, dict) or data.get("part") != part.name:
        return None
    rows: Any = data.get("rows")
    ranges = data.get("row_ranges")
    if not _is_int(rows) or rows < 0 or not isinstance(ranges, list):
        return None
    for pair in ranges:
        if not (isinstance(pair, list) and len(pair) == 2 and all(map(_is_int, pair))):
            return None
        if not 0 <= pair[0] < pair[1]:
            return None
    if sum(stop - start for start, stop in ranges) > rows:  # more rows than the part holds
        return None
    times = [data.get("run_started"), data.get("written")]
    if not all(t is None or _is_time(t) for t in times):
        return None
    return data


def _scan(directory: Path) -> list[os.DirEntry[str]]:
    """The entries of a directory ([] if it is not one); their types come without a stat."""
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except OSError:
        return []


def claims_home(claims_dir: Path, output: str) -> Path:
    """Where the claims of an object-store output live in claims_dir: a directory named after the
    output's URI (readable, and unique by its hash), holding its _claims."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", output)[:100]
    return claims_dir / f"{readable}-{sha256(output.encode()).hexdigest()[:12]}"


class OutputDir:
    """One shard's (or the whole job's) view of the output directory (a local directory, or an
    object-store prefix in `store`; claims_dir: where an object-store output's claims live)."""

    def __init__(
        self,
        path: PurePath,
        shard: tuple[int, int] | None = None,
        rows: range | None = None,
        *,
        store: Store = LOCAL,
        claims_dir: Path | None = None,
    ) -> None:
        self.path, self.store, self.claims_dir = path, store, claims_dir
        self.progress = path / PROGRESS_DIR
        self.names = PartNames(shard)
        self.rows = rows  # the row_index range this run covers (its shard's), for its claim
        self._next_number: int | None = None  # of this shard's next part, found on first commit
        self._claim: Claim | None = None
        # Also checked before each commit: a worker of a multi-worker job holds no claim of the
        # output (its parent does) and checks that the parent still runs.
        self.guard: Callable[[], None] | None = None
        self._job: str | None = None  # this job's hash, once check() or prepare() saw it
        self._footers: dict[tuple[str, int, int], _Footer] = {}  # parts never change in place
        self.run_started = time.time()  # for part manifests; prepare() restarts it (engine ready)

    @classmethod
    def at(
        cls,
        spec: str,
        shard: tuple[int, int] | None = None,
        rows: range | None = None,
        claims_dir: str | None = None,
    ) -> OutputDir:
        """The output named by --output: a local directory or an object-store URI."""
        store = store_for(spec)
        claims = Path(claims_dir) if claims_dir is not None else None
        return cls(store.path(spec), shard, rows, store=store, claims_dir=claims)

    @property
    def shown(self) -> str:
        """The output as the user names it: its path, or its URI."""
        return self.store.shown(self.path)

    # -- the claim --------------------------------------------------------------------------

    def acquire(self) -> None:
        """Claim the directory (or this shard's rows of it); JobError if another run holds it."""
        rows = None if self.rows is None else (self.rows.start, self.rows.stop)
        self._claim = acquire(self.claim_space(), self.names.shard, rows, shown=self.shown)

    def release(self) -> None:
        if self._claim is not None:
            self._claim.release()
            self._claim = None

    def _verify_claim(self) -> None:
        if self._claim is not None:
            self._claim.verify()
        if self.guard is not None:
            self.guard()

    def claim_space(self) -> ClaimSpace:
        """Where this output's claims live: OUT/_claims (of a local output, or in an s3://
        output's bucket), or claims_dir when it is set for an object-store output."""
        if self.store.local:
            return DirectoryClaims(Path(self.path) / CLAIMS_DIR, f"output directory {self.shown!r}")
        if self.claims_dir is not None:
            return DirectoryClaims(claims_home(self.claims_dir, self.shown) / CLAIMS_DIR)
        assert self._claims_in_bucket  # check() refused the output otherwise
        return BucketClaims(PurePosixPath(self.path) / CLAIMS_DIR)

    @property
    def _claims_in_bucket(self) -> bool:
        return ObjectLocation.parse(self.shown).scheme in CLAIMS_IN_BUCKET

    def chunk_claims(self) -> ClaimSpace:
        """Where the workers of a multi-worker job claim chunks of rows: beside the output's
        claims, one space per chunk."""
        return self.claim_space().child(CHUNKS_DIR)

    # -- start-up ---------------------------------------------------------------------------

    def check(self, fingerprint: dict[str, Any], overwrite: bool) -> None:
        """Raise JobError if the directory cannot take this job's output. Writes nothing."""
        self._job = job_hash(fingerprint)
        if self.store.local:
            self._check_local()
        else:
            self._check_object_store()
        if overwrite or not self.all_parts():
            return
        recorded = self._recorded_fingerprint()
        if recorded is None:
            raise JobError(
                f"output {self.shown!r} holds part files but no {PROGRESS_DIR}/{JOB_FILE} "
                "that batchrun can read; use --overwrite or another --output"
            )
        differs = first_difference(recorded, fingerprint)
        if differs == "version":
            why = "it was written by another batchrun version"
        elif differs is not None:
            why = f"{differs} differs"
        else:
            foreign = [p for p in self._claimed_parts() if self._is_other_jobs(p)]
            if not foreign:
                return
            by = "another job" if self._footer(foreign[0]).job else "something other than batchrun"
            why = f"{foreign[0].name} was written by {by}"
        raise JobError(
            f"output {self.shown!r} holds parts of a different job ({why}); "
            "use --overwrite or another --output"
        )

    def _check_local(self) -> None:
        path = Path(self.path)
        if path.exists() and not path.is_dir():
            raise JobError(f"output {self.shown!r} exists and is not a directory")
        existing = path
        while not existing.exists():
            existing = existing.parent
        if not os.access(existing, os.W_OK | os.X_OK):
            raise JobError(f"output {self.shown!r} is not writable")
        self._check_layout()

    def _check_object_store(self) -> None:
        """JobError unless the bucket answers and exists, nothing blocks the prefix, and the
        claims have a place: the bucket of an s3:// output, else a claims_dir that can be made."""
        bucket = self.path.parts[0]
        try:
            if self.store.kind(PurePath(bucket)) != "dir":
                raise JobError(f"output {self.shown!r}: bucket {bucket!r} does not exist")
            if self.store.kind(self.path) == "file":
                raise JobError(f"output {self.shown!r} exists and is not a directory")
        except OSError as exc:
            raise JobError(f"output {self.shown!r}: {_reason(exc)}") from None
        if self.claims_dir is None and self._claims_in_bucket:
            require_boto3()
        elif self.claims_dir is None:
            raise JobError(
                f"output {self.shown!r}: claims are kept in the bucket only on s3:// (through "
                "its conditional writes); set claims_dir (--claims-dir) to a local or shared "
                "directory that every run of this job reaches"
            )
        if self.claims_dir is None:
            return
        problem = unmakeable(claims_home(self.claims_dir, self.shown))
        if problem is not None:  # acquire() makes it: refused here, by validate too
            raise JobError(f"claims_dir {str(self.claims_dir)!r} cannot be made: {problem}")

    def _check_layout(self) -> None:
        """JobError unless a run can work here without following a symlink: its directories
        are real ones (or absent), and no file it may write, replace or delete is a symlink (nor
        a directory where it writes a file)."""
        path, progress = Path(self.path), Path(self.progress)
        for directory in (progress, path / CLAIMS_DIR, progress / DAMAGED_DIR):
            refuse_symlink(directory)
            if directory.exists() and not directory.is_dir():
                raise JobError(f"{str(directory)!r} is not a directory; batchrun keeps one there")
        entries = [e for e in _scan(path) if is_output_file(e.name) or is_temp(e.name)]
        for directory in (progress, progress / DAMAGED_DIR, path / CLAIMS_DIR):
            entries += _scan(directory)  # everything in them is batchrun's
        for entry in entries:
            if entry.is_symlink():
                refuse_symlink(Path(entry.path))
            name = entry.name
            file = name == SUCCESS_FILE or name.endswith((".json", ".claim")) or is_temp(name)
            if file and entry.is_dir():
                raise JobError(f"{entry.path!r} is a directory; batchrun writes a file there")

    def prepare(self, fingerprint: dict[str, Any], overwrite: bool) -> list[str]:
        """Under the claim: clear (with overwrite) or recover after a kill, and record the job.

        Returns the names of damaged parts moved aside (their rows are not done).
        """
        self._verify_claim()
        self.check(fingerprint, overwrite)  # again, now that this run holds the claim
        self.run_started = time.time()
        try:
            if overwrite:
                self._clear()
            self._next_number = None
            self.store.make_dir(self.progress)
            text = json.dumps(fingerprint, indent=2) + "\n"
            self.store.write_text(self.progress / JOB_FILE, text)
            for directory in (self.path, self.progress):
                for entry in self.store.glob(directory, "*"):
                    if self._is_our_temp(entry.name):
                        self.store.remove(entry)
            moved = self._move_damaged_aside()
            self._drop_orphan_manifests()
            for part in self.all_parts():
                manifest = self._manifest(part)
                footer = self._footer(part)
                stale = (manifest or {}).get("rows") != footer.rows
                if footer.present and footer.damage is None and stale:
                    self._write_manifest(part, self._part_rows(part))
        except OSError as exc:
            raise JobError(
                f"cannot prepare output directory {self.shown!r}: {_reason(exc)}"
            ) from exc
        return moved

    def _is_our_temp(self, name: str) -> bool:
        # Temps of a shard's parts, manifests and stats carry its tag; unsharded owns them all.
        return is_temp(name) and (self.names.shard is None or self.names.tag in name)

    def _claimed_parts(self) -> list[PurePath]:
        """The parts this run may change: every part unsharded (its claim covers every row)."""
        return self.all_parts() if self.names.shard is None else self.own_parts()

    def _clear(self) -> None:
        if self.names.shard is None:
            self.store.remove(self.progress / JOB_FILE)  # an interrupted clear cannot resume
            self.store.remove_tree(self.progress)  # check(): holds no symlink
            doomed = [*self.all_parts(), self.path / STATS_FILE]
        else:
            doomed = self.own_parts()
            doomed += [self._manifest_path(p) for p in doomed] + [self.stats_path]
        for path in [self.path / SUCCESS_FILE, *doomed]:
            self.store.remove(path)

    def _move_damaged_aside(self) -> list[str]:
        damaged = [part for part in self._claimed_parts() if self.damaged(part)]
        if damaged:
            self.store.make_dir(self.progress / DAMAGED_DIR)
        for part in damaged:
            target = self.progress / DAMAGED_DIR / part.name
            taken = os.path.lexists(target) if self.store.local else self.store.exists(target)
            if taken:  # never replace an entry, not even a dangling link
                target = target.with_name(f"{part.name}.{time.time_ns()}")
            self.store.move(part, target)
            self.store.remove(self._manifest_path(part))
        return [part.name for part in damaged]

    def _drop_orphan_manifests(self) -> None:
        """A manifest whose part is gone would mark the rows of a later part of that name done."""
        own = {p.stem for p in self._claimed_parts()}
        for manifest in self.store.glob(self.progress, "part-*.json"):
            is_ours = self.names.number(manifest.stem + ".parquet") is not None
            if (is_ours or self.names.shard is None) and manifest.stem not in own:
                self.store.remove(manifest)

    def use_recorded_job(self) -> None:
        """For readers (`batchrun stats`, `report`): take the job of _progress/job.json as this
        one, so that committed_parts() are the parts a run of it counts as done."""
        recorded = self._recorded_fingerprint()
        self._job = job_hash(recorded) if recorded is not None else None

    def _recorded_fingerprint(self) -> dict[str, Any] | None:
        try:
            recorded = json.loads(self.store.read_text(self.progress / JOB_FILE))
        except (OSError, ValueError):
            return None
        return recorded if isinstance(recorded, dict) else None

    # -- committed rows ---------------------------------------------------------------------

    def all_parts(self) -> list[PurePath]:
        """Every shard's part files, sorted by name."""
        return sorted(self.store.glob(self.path, PART_PATTERN))

    def own_parts(self) -> list[PurePath]:
        return [p for p in self.all_parts() if self.names.number(p.name) is not None]

    def _footer(self, part: PurePath) -> _Footer:
        try:
            size, mtime_ns = self.store.stat(part)
        except FileNotFoundError:
            return _Footer(0, None, None, present=False)
        except OSError as exc:
            raise JobError(f"cannot read output {self.shown!r}: {_reason(exc)}") from None
        key = (part.name, size, mtime_ns)
        if key not in self._footers:
            self._footers[key] = _read_footer(self.store, part)
        return self._footers[key]

    def damaged(self, part: PurePath) -> bool:
        return self._footer(part).damage is not None

    def damaged_parts(self) -> dict[str, str]:
        """{part name: why} for every part whose footer cannot be read; a run redoes their rows."""
        return {
            part.name: damage
            for part in self.all_parts()
            if (damage := self._footer(part).damage) is not None
        }

    def _is_other_jobs(self, part: PurePath) -> bool:
        footer = self._footer(part)
        readable = footer.present and footer.damage is None
        return readable and self._job is not None and footer.job != self._job

    def committed_parts(self) -> list[PurePath]:
        """The readable parts of this job (of every shard): those whose rows are done. Without a
        recorded job (readers of an old output), every readable part batchrun wrote."""
        return [
            part
            for part in self.all_parts()
            if (footer := self._footer(part)).present
            and footer.damage is None
            and footer.job
            and (self._job is None or footer.job == self._job)
        ]

    def foreign_parts(self) -> list[PurePath]:
        """Readable parts without batchrun's job key: files batchrun did not write."""
        return [
            part
            for part in self.all_parts()
            if (footer := self._footer(part)).present and footer.damage is None and not footer.job
        ]

    def stats_parts(self) -> list[PurePath]:
        """The parts a run's stats cover: unsharded, every committed part (stats.json is job-wide,
        other shards' included); a shard, its own."""
        parts = self.committed_parts()
        if self.names.shard is None:
            return parts
        return [p for p in parts if self.names.number(p.name) is not None]

    def done_mask(self, total_rows: int) -> np.ndarray:
        """True for each row_index with a committed output row (by any shard)."""
        done = np.zeros(total_rows, dtype=bool)
        for part in self.committed_parts():
            try:
                ranges = self._row_ranges(part)
            except FileNotFoundError:
                continue  # cleared by another shard's overwrite since it was listed
            for start, stop in ranges:
                done[max(start, 0) : max(stop, 0)] = True  # a forged part's negative rows: none
        return done

    def part_row_ranges(self, part: PurePath) -> list[list[int]]:
        """The [start, stop) row_index ranges a committed part holds."""
        return self._row_ranges(part)

    def _row_ranges(self, part: PurePath) -> list[list[int]]:
        manifest = self._manifest(part)
        if manifest is not None and manifest.get("rows") == self._footer(part).rows:
            return list(manifest["row_ranges"])
        # Between a part's rename and its manifest (a kill, or another shard now): read the part.
        return row_ranges(self._part_rows(part))

    def read_table(self, part: PurePath, columns: list[str]) -> pa.Table:
        """Columns of a part; JobError (one line) if the store cannot be read."""
        try:
            return self.store.read_table(part, columns)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if self.store.local:
                raise
            raise JobError(f"cannot read {self.store.shown(part)}: {_reason(exc)}") from None

    def read_schema(self, part: PurePath) -> pa.Schema:
        return self.store.read_schema(part)

    def _part_rows(self, part: PurePath) -> np.ndarray:
        """The row indices a committed part holds, read from the part itself."""
        return self.read_table(part, ["row_index"]).column("row_index").to_numpy()

    def commit(self, table: pa.Table) -> PurePath:
        """Write the next part atomically, then its manifest; JobError if that fails."""
        self._verify_claim()
        if self.store.local:
            refuse_symlink(Path(self.progress))  # check() saw none; nor may one appear since
        if self._next_number is None:
            numbers = [self.names.number(p.name) for p in self.own_parts()]
            self._next_number = max((n for n in numbers if n is not None), default=-1) + 1
        path = self.path / self.names.name(self._next_number)
        if self._job is not None:
            table = table.replace_schema_metadata({JOB_KEY: self._job.encode()})
        try:
            self.store.write_part(path, table)
            self._next_number += 1
            times = {"run_started": round(self.run_started, 3), "written": round(time.time(), 3)}
            self._write_manifest(path, table.column("row_index").to_numpy(), times)
        except OSError as exc:
            raise JobError(
                f"cannot write {path.name} in output {self.shown!r}: {_reason(exc)}; "
                "stopping (rows not committed are redone by the next run)"
            ) from exc
        return path

    def _manifest_path(self, part: PurePath) -> PurePath:
        return self.progress / f"{part.stem}.json"

    def _write_manifest(
        self, part: PurePath, indices: np.ndarray, times: dict[str, float] | None = None
    ) -> None:
        """times: when the part's run started generating and when the part was written (Unix
        seconds), for throughput over time; unknown to a manifest rebuilt from its part."""
        manifest = {"part": part.name, "rows": len(indices), "row_ranges": row_ranges(indices)}
        self.store.write_text(
            self._manifest_path(part), json.dumps({**manifest, **(times or {})}) + "\n"
        )

    def part_times(self, part: PurePath) -> tuple[float | None, float]:
        """When a part's run started generating (None if its manifest does not say) and when
        the part was written (else its file's mtime)."""
        manifest = self._manifest(part) or {}
        written = manifest.get("written")
        if written is None:
            written = self.store.stat(part)[1] / 1e9
        return manifest.get("run_started"), written

    def _manifest(self, part: PurePath) -> dict[str, Any] | None:
        try:
            manifest = json.loads(self.store.read_text(self._manifest_path(part)))
        except (OSError, ValueError):
            return None
        return _valid_manifest(manifest, part)

    # -- stats and completion ---------------------------------------------------------------

    @property
    def stats_path(self) -> PurePath:
        """stats.json, or with a shard its own file in _progress/ (stats.json is job-wide)."""
        if self.names.shard is None:
            return self.path / STATS_FILE
        return self.progress / f"stats-{self.names.tag}.json"

    def shard_timings(self) -> list[Timing]:
        """The timing each shard's stats file records (files that do not hold one are skipped)."""
        timings = []
        for path in self.store.glob(self.progress, "stats-*.json"):
            try:
                data = json.loads(self.store.read_text(path))
                values = [data[k] for k in ("wall_seconds", "load_seconds", "generation_seconds")]
            except (OSError, ValueError, TypeError, KeyError):
                continue
            if all(isinstance(v, int | float) and math.isfinite(v) for v in values):
                timings.append(Timing(*values))
        return timings

    def write_json(self, path: PurePath, data: dict[str, Any]) -> None:
        try:
            self.store.write_text(path, json.dumps(data, indent=2) + "\n")
        except OSError as exc:
            raise JobError(f"cannot write {self.store.shown(path)!r}: {_reason(exc)}") from exc

    def complete(self) -> bool:
        """Whether _SUCCESS is there: every input row has its output rows."""
        return self.store.exists(self.path / SUCCESS_FILE)

    def mark_success(self) -> None:
        self._verify_claim()
        try:
            self.store.write_text(self.path / SUCCESS_FILE, "")
        except OSError as exc:
            raise JobError(
                f"cannot write {SUCCESS_FILE} in {self.shown!r}: {_reason(exc)}"
            ) from exc

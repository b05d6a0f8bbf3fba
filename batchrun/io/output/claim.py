"""An exclusive claim on an output directory, or on the rows of one shard of it.

Built for shared cluster filesystems (NFS, Lustre), where flock/fcntl locks are unreliable: only
exclusive file creation, directory listings, reads and mtimes are used.

Every run creates its own claim file, OUT/_claims/<token>.claim, with O_CREAT|O_EXCL, holding its
host, boot id, pid, the process start time (so a reused pid is not taken for the holder), its
shard and the row_index range the shard covers (rows_overlap says which runs conflict); a daemon
thread touches the file's mtime as a heartbeat. Then the run lists the other claims. A live
claim on overlapping rows makes it withdraw its own file and stop; a stale one
(same host and the process gone or started at another time, or another host's heartbeat older
than STALE_AFTER_SECONDS) it deletes. Of two runs on overlapping rows, the one that lists second
always sees the other's file, so at most one of them holds a claim. Since each file's name is
unique, deleting a stale claim can never delete a newer live one that took its place: no rename
dance is needed for a race-free take-over.

An object-store output (no create-if-absent write in pyarrow) keeps its claims in a local or
shared directory instead (claims_dir): acquire(home, ..., shown=its URI), messages naming the URI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from batchrun.errors import JobError
from batchrun.io.parts import refuse_symlink, remove

CLAIMS_DIR = "_claims"
CLAIM_SUFFIX = ".claim"
HEARTBEAT_SECONDS = 5.0
STALE_AFTER_SECONDS = 300.0  # another host's claim without a heartbeat this long is stale
UNWRITTEN_GRACE_SECONDS = 30.0  # a claim file still empty this long was never finished
# Runs that start together may see each other's fresh claims and all withdraw: they retry a few
# times after a random pause. A claim older than this belongs to a run well under way: no retry.
FRESH_SECONDS = 3.0
ATTEMPTS = 8
MAX_SINCE = 1e11  # seconds since the epoch (year 5138): a later claim time is not a real one

Shard = tuple[int, int] | None
RowRange = tuple[int, int]  # [start, stop) of row_index


def rows_overlap(a: Shard, a_rows: RowRange | None, b: Shard, b_rows: RowRange | None) -> bool:
    """Whether runs of shards a and b (None: unsharded), covering the given row ranges (None:
    unknown), may not run side by side.

    Two different shards conflict iff their rows intersect. The same shard always conflicts,
    also without rows (both would write the same part names), and an unsharded run conflicts
    with every run: it owns every part (an overwrite or a recovery touches all of them).
    """
    if a == b or a is None or b is None or a_rows is None or b_rows is None:
        return True
    return max(a_rows[0], b_rows[0]) < min(a_rows[1], b_rows[1])


def process_start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks after boot); None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields 3.. follow the command name's ')'


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _process_alive(pid: int, start_time: str | None) -> bool:
    """On this host: is pid the process that wrote the claim?"""
    if Path("/proc/self/stat").exists():
        current = process_start_time(pid)
        return current is not None and (start_time is None or current == start_time)
    try:  # no /proc: a signal 0 tells whether the pid exists at all
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class ClaimInfo:
    """What a claim file holds."""

    host: str
    boot_id: str  # a rebooted host reuses pids and start times
    pid: int
    start_time: str | None
    since: float  # seconds since the epoch
    shard: Shard
    token: str  # unique: also the file's name
    rows: RowRange | None = None  # the rows its run covers; None: unknown, every row

    @classmethod
    def for_this_process(cls, shard: Shard, rows: RowRange | None = None) -> ClaimInfo:
        pid = os.getpid()
        return cls(
            host=socket.gethostname(),
            boot_id=_boot_id(),
            pid=pid,
            start_time=process_start_time(pid),
            since=time.time(),
            shard=shard,
            token=uuid.uuid4().hex,
            rows=rows,
        )

    @classmethod
    def from_json(cls, text: str) -> ClaimInfo:
        """ValueError unless text is a claim as batchrun writes it (a claim file is not trusted:
        one that is not is unreadable, as one still being written is)."""
        data: Any = json.loads(text)
        if not isinstance(data, dict) or set(data) - _FIELD_TYPES.keys():
            raise ValueError("not a claim")
        data.setdefault("rows", None)
        for key, types in _FIELD_TYPES.items():
            value = data.get(key, _MISSING)
            if isinstance(value, bool) or not isinstance(value, types):
                raise ValueError(f"claim field {key!r}: {value!r}")
        # A pid os.kill takes, a time datetime can show (the message naming a live holder).
        if not (0 < data["pid"] < 2**31 and 0 <= data["since"] < MAX_SINCE):
            raise ValueError("claim pid or since out of range")
        data["shard"], data["rows"] = _pair(data["shard"]), _pair(data["rows"])
        return cls(**data)

    def overlaps(self, other: ClaimInfo) -> bool:
        return rows_overlap(self.shard, self.rows, other.shard, other.rows)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self)) + "\n"

    def describe(self) -> str:
        since = datetime.fromtimestamp(self.since, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
        return f"pid {self.pid} on host {self.host} since {since}{_describe(self.shard, self.rows)}"

    def is_stale(self, mtime: float) -> bool:
        """Whether the run that wrote this claim is gone (mtime: the claim file's heartbeat)."""
        if self.host == socket.gethostname() and self.boot_id == _boot_id():
            return not _process_alive(self.pid, self.start_time)
        return time.time() - mtime > STALE_AFTER_SECONDS


_MISSING = object()
# Each field's JSON types (never a boolean); rows may be absent (claims of earlier versions).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "host": (str,),
    "boot_id": (str,),
    "pid": (int,),
    "start_time": (str, type(None)),
    "since": (int, float),
    "shard": (list, type(None)),
    "token": (str,),
    "rows": (list, type(None)),
}


def _pair(value: list[Any] | None) -> tuple[int, int] | None:
    """A shard [I, N] or rows [start, stop] as a tuple of two ints; ValueError otherwise."""
    if value is None:
        return None
    if len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"not two integers: {value!r}")
    return value[0], value[1]


def _describe(shard: Shard, rows: RowRange | None) -> str:
    """A claim's shard in words: ' (shard 1/4, rows 250-499)', or '' unsharded."""
    if shard is None:
        return ""
    if rows is None:
        return f" (shard {shard[0]}/{shard[1]})"
    what = f"rows {rows[0]}-{rows[1] - 1}" if rows[1] > rows[0] else "no rows"
    return f" (shard {shard[0]}/{shard[1]}, {what})"


def claim_path(out: Path, token: str) -> Path:
    return out / CLAIMS_DIR / f"{token}{CLAIM_SUFFIX}"


def create_claim_file(path: Path, info: ClaimInfo) -> None:
    """Create path exclusively and write info to it; FileExistsError if it exists."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.write(fd, info.to_json().encode())
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _Seen:
    info: ClaimInfo | None  # None: a claim file still being written
    age: float  # seconds since its creation (or, unwritten, its mtime)


def _live_conflicts(directory: Path, own: ClaimInfo) -> list[_Seen]:
    """Other live claims on rows that overlap own's; stale ones are deleted on the way."""
    live: list[_Seen] = []
    for path in directory.glob("*" + CLAIM_SUFFIX):
        if path.name == f"{own.token}{CLAIM_SUFFIX}":
            continue
        try:
            mtime = path.stat().st_mtime
            text = path.read_text()
        except FileNotFoundError:
            continue  # released or taken over meanwhile
        try:
            info = ClaimInfo.from_json(text)
        except ValueError:
            if time.time() - mtime <= UNWRITTEN_GRACE_SECONDS:
                live.append(_Seen(None, time.time() - mtime))
            else:  # its writer died between creating and writing it
                remove(path)
            continue
        if not info.overlaps(own):
            continue
        if info.is_stale(mtime):
            remove(path)  # unique name: this deletes that claim and no other
        else:
            live.append(_Seen(info, time.time() - info.since))
    return live


def _conflict_message(out: str, own: ClaimInfo, seen: _Seen) -> str:
    what = f"output {out!r}{_describe(own.shard, own.rows)}"
    holder = seen.info.describe() if seen.info else "a run whose claim is being written"
    return (
        f"{what} is being written by {holder}; wait for it to end or stop it "
        "(a claim whose run was killed is taken over by the next run)"
    )


def acquire(
    out: Path, shard: Shard, rows: RowRange | None = None, *, shown: str | None = None
) -> Claim:
    """Claim out (or its shard, covering `rows`) for this process; JobError if another live run
    holds overlapping rows. Claim files go to out/_claims; shown: the output's name in messages
    (default: out)."""
    directory = out / CLAIMS_DIR
    name = str(out) if shown is None else shown
    refuse_symlink(directory)  # its claims would be made and deleted elsewhere
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise JobError(
            f"cannot create {'output' if shown is None else 'claims'} directory "
            f"{str(out if shown is None else directory)!r}: {exc.strerror or exc}"
        ) from exc
    for attempt in range(ATTEMPTS):
        info = ClaimInfo.for_this_process(shard, rows)
        path = claim_path(out, info.token)
        try:
            create_claim_file(path, info)
            conflicts = _live_conflicts(directory, info)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise JobError(f"cannot claim output {name!r}: {exc.strerror or exc}") from exc
        if not conflicts:
            return Claim(name, path, info)
        path.unlink(missing_ok=True)
        if attempt == ATTEMPTS - 1 or min(s.age for s in conflicts) > FRESH_SECONDS:
            raise JobError(_conflict_message(name, info, conflicts[0]))
        time.sleep(random.uniform(0.02, 0.2))
    raise AssertionError("unreachable")


def try_claim(directory: Path, rows: RowRange) -> Path | None:
    """One attempt, never waiting: claim `rows` (a chunk of a multi-worker job, whose workers
    share one output: batchrun.runners.workers) with a claim file in `directory`. Returns the
    file (delete it to release the claim), or None if a live claim there overlaps (stale ones
    are deleted on the way: a claim of a process that is gone is taken over at once on its host).
    Of two workers claiming at once, the one that lists second sees the other's file: at most one
    holds the rows; both may withdraw, and try again on their next pass."""
    info = ClaimInfo.for_this_process((rows[0], rows[1]), rows)
    path = directory / f"{info.token}{CLAIM_SUFFIX}"
    create_claim_file(path, info)
    if _live_conflicts(directory, info):
        path.unlink(missing_ok=True)
        return None
    return path


class Claim:
    """A claim this process holds; a daemon thread beats its heartbeat until release()."""

    def __init__(self, out: str, path: Path, info: ClaimInfo) -> None:
        self.out, self.path, self.info = out, path, info
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat_forever, name="claim-heartbeat")
        self._thread.daemon = True
        self._thread.start()

    def _beat_forever(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                os.utime(self.path)
            except OSError:
                return  # gone: verify() reports it before the next commit
            self._last_beat = time.monotonic()

    def verify(self) -> None:
        """Raise JobError unless this process still holds the claim (called before commits)."""
        try:
            info = ClaimInfo.from_json(self.path.read_text())
        except (FileNotFoundError, ValueError):  # gone, or no longer this run's claim
            self._lost()
        if info.token != self.info.token:
            self._lost()
        if time.monotonic() - self._last_beat > STALE_AFTER_SECONDS / 2:
            # This process stood still (suspended, swapped out): another host may have judged it
            # dead. Beat, then look: a run that claimed before the beat is listed now, and one
            # that looks after it sees a fresh heartbeat and withdraws.
            os.utime(self.path)
            self._last_beat = time.monotonic()
            if _live_conflicts(self.path.parent, self.info):
                self._lost()

    def _lost(self) -> NoReturn:
        conflicts = _live_conflicts(self.path.parent, self.info)
        why = (
            f"it is held by {conflicts[0].info.describe()}"
            if conflicts and conflicts[0].info
            else "its claim file is gone"
        )
        raise JobError(
            f"output {self.out!r} is no longer claimed by this run ({why}); stopping "
            "without committing more (the rows not committed are done by the next run)"
        )

    def release(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)

"""An exclusive claim on an output directory, or on the rows of one shard of it.

Claim files live in a ClaimSpace (batchrun.io.output.claim_space): a directory (a local output's
_claims, or claims_dir) or an s3:// output's bucket (bucket_claims.py); one protocol over either.

Every run creates its own claim file, <token>.claim, exclusively, holding its host, boot id, pid,
the process start time (so a reused pid is not taken for the holder), its shard and the row_index
range the shard covers (rows_overlap says which runs conflict); a daemon thread refreshes the
file's heartbeat (its mtime). Then the run lists the other claims. A live claim on overlapping
rows makes it withdraw its own file and stop; a stale one (same host and the process gone or
started at another time, or another host's heartbeat older than STALE_AFTER_SECONDS) it deletes.
Of two runs on overlapping rows, the one that lists second always sees the other's file, so at
most one of them holds a claim. Since each file's name is unique, deleting a stale claim can
never delete a newer live one that took its place: no rename dance is needed for a race-free
take-over, and a heartbeat never brings a deleted claim back (its holder then stops).
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
from batchrun.io.output.claim_space import CLAIM_SUFFIX, ClaimSpace

CLAIMS_DIR = "_claims"
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


def claim_name(token: str) -> str:
    return f"{token}{CLAIM_SUFFIX}"


@dataclass(frozen=True)
class _Seen:
    info: ClaimInfo | None  # None: a claim file still being written
    age: float  # seconds since its creation (or, unwritten, its mtime)


def _live_conflicts(space: ClaimSpace, own: ClaimInfo) -> list[_Seen]:
    """Other live claims on rows that overlap own's; stale ones are deleted on the way."""
    live: list[_Seen] = []
    for entry in space.entries():
        if entry.name == claim_name(own.token):
            continue
        try:
            info = ClaimInfo.from_json(entry.text)
        except ValueError:
            if time.time() - entry.mtime <= UNWRITTEN_GRACE_SECONDS:
                live.append(_Seen(None, time.time() - entry.mtime))
            else:  # its writer died between creating and writing it
                space.remove(entry.name)
            continue
        if not info.overlaps(own):
            continue
        if info.is_stale(entry.mtime):
            space.remove(entry.name)  # unique name: this deletes that claim and no other
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


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def acquire(space: ClaimSpace, shard: Shard, rows: RowRange | None, *, shown: str) -> Claim:
    """Claim an output (or its shard, covering `rows`) for this process, with a claim file in
    `space`; JobError if another live run holds overlapping rows. shown: the output's name in
    messages."""
    space.prepare()
    for attempt in range(ATTEMPTS):
        info = ClaimInfo.for_this_process(shard, rows)
        name = claim_name(info.token)
        try:
            if not space.create(name, info.to_json()):
                continue  # a unique name taken: another token
            conflicts = _live_conflicts(space, info)
        except OSError as exc:
            with contextlib.suppress(OSError):
                space.remove(name)
            raise JobError(f"cannot claim output {shown!r}: {_reason(exc)}") from exc
        if not conflicts:
            return Claim(shown, space, name, info)
        space.remove(name)
        if attempt == ATTEMPTS - 1 or min(s.age for s in conflicts) > FRESH_SECONDS:
            raise JobError(_conflict_message(shown, info, conflicts[0]))
        time.sleep(random.uniform(0.02, 0.2))
    raise JobError(f"cannot claim output {shown!r}: no claim file could be created")


def try_claim(space: ClaimSpace, rows: RowRange) -> str | None:
    """One attempt, never waiting: claim `rows` (a chunk of a multi-worker job, whose workers
    share one output: batchrun.runners.workers) with a claim file in `space`. Returns the file's
    name (remove it from the space to release the claim), or None if the rows are taken: a live
    claim there overlaps, or the exclusive create lost (stale claims are deleted on the way: a
    claim of a process that is gone is taken over at once on its host). Of two workers claiming
    at once, the one that lists second sees the other's file: at most one holds the rows; both
    may withdraw, and try again on their next pass. OSError if the space cannot be reached."""
    info = ClaimInfo.for_this_process((rows[0], rows[1]), rows)
    name = claim_name(info.token)
    if not space.create(name, info.to_json()):
        return None
    if _live_conflicts(space, info):
        space.remove(name)
        return None
    return name


class Claim:
    """A claim this process holds; a daemon thread beats its heartbeat until release()."""

    def __init__(self, out: str, space: ClaimSpace, name: str, info: ClaimInfo) -> None:
        self.out, self.space, self.name, self.info = out, space, name, info
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat_forever, name="claim-heartbeat")
        self._thread.daemon = True
        self._thread.start()

    def _beat_forever(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                if not self.space.beat(self.name):
                    return  # gone: verify() reports it before the next commit
            except OSError:
                continue  # the store did not answer: beat again next time
            self._last_beat = time.monotonic()

    def verify(self) -> None:
        """Raise JobError unless this process still holds the claim (called before commits)."""
        try:
            self._verify()
        except OSError as exc:
            raise JobError(
                f"cannot read the claims of output {self.out!r}: {_reason(exc)}; stopping "
                "without committing more (the rows not committed are done by the next run)"
            ) from exc

    def _verify(self) -> None:
        try:
            info = ClaimInfo.from_json(self.space.read(self.name))
        except (FileNotFoundError, ValueError):  # gone, or no longer this run's claim
            self._lost()
        if info.token != self.info.token:
            self._lost()
        if time.monotonic() - self._last_beat > STALE_AFTER_SECONDS / 2:
            # This process stood still (suspended, swapped out): another host may have judged it
            # dead. Beat, then look: a run that claimed before the beat is listed now, and one
            # that looks after it sees a fresh heartbeat and withdraws.
            if not self.space.beat(self.name):
                self._lost()
            self._last_beat = time.monotonic()
            if _live_conflicts(self.space, self.info):
                self._lost()

    def _lost(self) -> NoReturn:
        conflicts = _live_conflicts(self.space, self.info)
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
            self.space.remove(self.name)

"""The two places claims live (batchrun.io.output.claim_space): a directory, and an s3:// output's
bucket through S3's conditional writes (bucket_claims.py), against a moto S3 server on loopback.
Both keep one contract: an exclusive create that loses cleanly, listings with heartbeats, and a
heartbeat that never brings a deleted claim back; and the claim protocol over the bucket elects
one holder, takes a dead holder's claim over and stops a holder whose claim was taken. A job
whose output is not in S3 never imports boto3."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

import pytest

from batchrun.errors import JobError
from batchrun.io.output import bucket_claims, claim
from batchrun.io.output.bucket_claims import BucketClaims
from batchrun.io.output.claim_space import CLAIM_SUFFIX, ClaimSpace, DirectoryClaims
from tests.io import test_object_storage as object_storage
from tests.job.test_cli import write_job, write_prompts

REPO = Path(__file__).resolve().parents[2]

endpoint = object_storage.endpoint  # a moto S3 server on loopback, for this module
bucket = object_storage.bucket


@pytest.fixture(params=["directory", "bucket"])
def space(request: pytest.FixtureRequest, tmp_path: Path) -> ClaimSpace:
    """An empty claim space of either kind, prepared."""
    made: ClaimSpace
    if request.param == "directory":
        made = DirectoryClaims(tmp_path / "out" / claim.CLAIMS_DIR)
    else:
        name = request.getfixturevalue("bucket")
        made = BucketClaims(PurePosixPath(name) / "out" / claim.CLAIMS_DIR)
    return prepared(made)


def claim_text(**fields: object) -> str:
    """A claim as another run would have written it; fields override this process's."""
    info = claim.ClaimInfo.for_this_process(shard=None)
    return claim.ClaimInfo(**{**dataclasses.asdict(info), **fields}).to_json()


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    return int(done.stdout)


def prepared(space: ClaimSpace) -> ClaimSpace:
    space.prepare()
    return space


def names(space: ClaimSpace) -> list[str]:
    return sorted(entry.name for entry in space.entries())


def at_once(count: int, attempt: Callable[[], object]) -> list[object]:
    """What `count` threads that call attempt() at the same moment return (or raise)."""
    barrier = threading.Barrier(count)
    results: list[object] = []

    def run() -> None:
        barrier.wait()
        try:
            results.append(attempt())
        except JobError as exc:
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


# -- the contract, for both kinds ----------------------------------------------------------------


def test_a_create_never_replaces_and_losing_is_a_clean_false(space: ClaimSpace) -> None:
    assert space.create("a.claim", "first")
    assert not space.create("a.claim", "second")
    assert space.read("a.claim") == "first"
    assert space.create("a.claim", "first")  # a retried create finds its own: still True
    # Creates racing for one name (S3: conditional puts): exactly one wins, the rest are False.
    won = at_once(6, lambda: space.create("b.claim", f"racer {threading.get_ident()}"))
    assert sorted(won, key=str) == [False] * 5 + [True]


def test_entries_are_the_claim_files_with_their_heartbeats(space: ClaimSpace) -> None:
    assert space.create("a.claim", "one") and space.create("notes.txt", "not a claim")
    chunks = prepared(space.child("chunks"))
    assert chunks.create("c.claim", "in a child")
    [entry] = space.entries()  # the child's claim and the other file are not listed
    assert (entry.name, entry.text) == ("a.claim", "one")
    assert abs(entry.mtime - time.time()) < 60
    assert names(chunks) == ["c.claim"]


def test_a_deleted_claim_stays_deleted(space: ClaimSpace) -> None:
    """A heartbeat refreshes a claim while it is there; once deleted (taken over as stale) it
    returns False and brings nothing back."""
    assert space.create("mine.claim", "held")
    assert space.beat("mine.claim")
    space.remove("mine.claim")
    space.remove("mine.claim")  # absent: nothing to do
    assert not space.beat("mine.claim")
    assert names(space) == []
    with pytest.raises(FileNotFoundError):
        space.read("mine.claim")


def test_remove_all_clears_the_children(space: ClaimSpace) -> None:
    for chunk in ("rows-0-4", "rows-4-8"):
        assert prepared(space.child("chunks").child(chunk)).create("x.claim", "held")
    space.child("chunks").remove_all()
    assert names(space.child("chunks").child("rows-0-4")) == []
    space.child("never-made").remove_all()  # absent: nothing to do


# -- the claim protocol over a bucket ------------------------------------------------------------


@pytest.fixture
def in_bucket(bucket: str) -> BucketClaims:
    return BucketClaims(PurePosixPath(bucket) / "out" / claim.CLAIMS_DIR)


def acquire(space: ClaimSpace, shard: claim.Shard = None) -> claim.Claim:
    rows = None if shard is None else (shard[0] * 10, shard[0] * 10 + 10)
    return claim.acquire(space, shard, rows, shown="s3://b/out")


def test_contenders_in_a_bucket_elect_exactly_one(in_bucket: BucketClaims) -> None:
    """A dead run's claim (this host, its process gone) is taken over by exactly one of six
    runs starting at once; the others are refused in one line, none fails otherwise."""
    stale = f"dead{CLAIM_SUFFIX}"
    assert in_bucket.create(stale, claim_text(token="dead", pid=dead_pid()))
    results = at_once(6, lambda: acquire(in_bucket))
    held = [r for r in results if isinstance(r, claim.Claim)]
    refused = [str(r) for r in results if isinstance(r, JobError)]
    assert len(held) == 1 and len(refused) == 5, results
    assert all("is being written by pid" in line and "\n" not in line for line in refused)
    assert names(in_bucket) == [held[0].name]  # the stale claim is gone
    held[0].release()
    assert names(in_bucket) == []


def test_shards_of_other_rows_hold_claims_side_by_side(in_bucket: BucketClaims) -> None:
    first, second = acquire(in_bucket, (0, 2)), acquire(in_bucket, (1, 2))
    with pytest.raises(JobError, match=r"\(shard 0/2, rows 0-9\) is being written by pid"):
        acquire(in_bucket, (0, 2))
    first.release()
    second.release()


def test_another_host_s_live_claim_refuses_and_its_stale_one_is_taken(
    in_bucket: BucketClaims, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = claim_text(token="node-b", host="node-b", boot_id="b", since=time.time())
    assert in_bucket.create(f"node-b{CLAIM_SUFFIX}", other)
    monkeypatch.setattr(claim, "FRESH_SECONDS", -1.0)  # no retries: a live conflict is final
    with pytest.raises(JobError, match="is being written by pid .* on host node-b"):
        acquire(in_bucket)
    monkeypatch.setattr(claim, "STALE_AFTER_SECONDS", -1.0)  # node-b's heartbeat: too old
    acquire(in_bucket).release()
    assert names(in_bucket) == []


def test_a_holder_whose_claim_was_taken_stops_and_brings_nothing_back(
    in_bucket: BucketClaims,
) -> None:
    holder = acquire(in_bucket)
    holder.verify()
    in_bucket.remove(holder.name)  # what a run that judged the holder dead does
    taker = BucketClaims(PurePosixPath(in_bucket.location.path))  # another run's view
    assert taker.create(f"taker{CLAIM_SUFFIX}", claim_text(token="taker"))
    assert not holder.space.beat(holder.name)  # the heartbeat does not revive it
    with pytest.raises(JobError, match="no longer claimed by this run"):
        holder.verify()
    assert names(in_bucket) == [f"taker{CLAIM_SUFFIX}"]
    holder.release()


def test_a_heartbeat_in_the_bucket_is_read_on_this_node_s_clock(
    in_bucket: BucketClaims, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node whose clock runs an hour ahead of the store's sees a fresh heartbeat as fresh (on
    the store's clock it would look an hour old: stale, and taken over)."""
    assert in_bucket.create(f"fresh{CLAIM_SUFFIX}", claim_text(token="fresh"))
    ahead = time.time() + 3600

    class Clock:
        @staticmethod
        def time() -> float:
            return ahead

    monkeypatch.setattr(bucket_claims, "time", Clock)
    [entry] = in_bucket.entries()
    assert abs(entry.mtime - ahead) < 5


def test_a_chunk_held_in_the_bucket_is_taken_until_released(in_bucket: BucketClaims) -> None:
    chunk = prepared(in_bucket.child("chunks").child("rows-0-4"))
    held = claim.try_claim(chunk, (0, 4))
    assert held is not None
    assert claim.try_claim(chunk, (0, 4)) is None  # taken: no error
    chunk.remove(held)
    again = claim.try_claim(chunk, (0, 4))
    assert again is not None and names(chunk) == [again]


# -- boto3 only for S3 ----------------------------------------------------------------------------


@pytest.fixture
def no_aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    yield


@pytest.mark.usefixtures("no_aws")
def test_a_local_job_does_not_import_boto3(tmp_path: Path, tiny_model: Path) -> None:
    write_prompts(tmp_path / "in", ["def f(x):", "import sys"])
    job = write_job(tmp_path, tiny_model)
    script = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('boto3' in sys.modules))\n"
        "from batchrun.cli import main\n"
        f"sys.argv = ['batchrun', 'run', {str(job)!r}]\n"
        "main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False"
    assert (tmp_path / "out" / "_SUCCESS").exists()
    assert not list((tmp_path / "out" / claim.CLAIMS_DIR).glob("*" + CLAIM_SUFFIX))

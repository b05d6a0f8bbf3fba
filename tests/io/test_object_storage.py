"""Jobs on object storage: s3:// input and output against a real S3 server on loopback (moto's
standalone server, which speaks the S3 protocol over HTTP), through the same environment a user
sets for AWS: whole jobs, a second run, a kill -9 and a resume, stats and report, and one-line
errors for an endpoint that does not answer, missing credentials and a missing bucket."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result
from moto.server import ThreadedMotoServer

from batchrun.cli import cli
from batchrun.errors import JobError
from batchrun.io.input.listing import resolve_input_paths
from batchrun.io.input.reader import open_input

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [f"def step_{i}(state):" for i in range(10)] + ["", "import os"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """A moto S3 server on a free loopback port, for the module's tests."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def bucket(endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A new bucket, and the environment a user of an S3-compatible store sets (no shared
    credential files, no instance metadata: what the test sets is all there is)."""
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials"),
        "AWS_CONFIG_FILE": str(tmp_path / "no-config"),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    name = f"batchrun-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


def s3(endpoint: str) -> pafs.S3FileSystem:
    """The test's own view of the store (not batchrun's)."""
    return pafs.S3FileSystem(
        endpoint_override=endpoint.removeprefix("http://"),
        scheme="http",
        access_key="testing",
        secret_key="testing",
        region="us-east-1",
    )


def put_prompts(fs: pafs.FileSystem, prefix: str, prompts: list[str], files: int = 2) -> None:
    table = pa.table({"prompt": prompts, "number": list(range(len(prompts)))})
    per_file = -(-len(prompts) // files)
    for number in range(files):
        chunk = table.slice(number * per_file, per_file)
        pq.write_table(chunk, f"{prefix}/{number}.parquet", filesystem=fs, row_group_size=3)


def names(fs: pafs.FileSystem, prefix: str) -> list[str]:
    selector = pafs.FileSelector(prefix, recursive=True, allow_not_found=True)
    return sorted(info.path.removeprefix(prefix + "/") for info in fs.get_file_info(selector))


def read_parts(fs: pafs.FileSystem, prefix: str) -> pa.Table:
    parts = [n for n in names(fs, prefix) if n.startswith("part-")]
    tables = [pq.read_table(f"{prefix}/{name}", filesystem=fs) for name in parts]
    return pa.concat_tables(tables).sort_by("row_index")


def write_job(tmp_path: Path, model: Path, bucket: str, **keys: object) -> Path:
    """A job from s3://BUCKET/in to s3://BUCKET/out; its claims in the bucket unless keys name a
    claims_dir."""
    settings = {"max_tokens": 6, "rows_per_part": 3, "max_batch_size": 3, **keys}
    job = tmp_path / "job.toml"
    job.write_text(
        f'input = "s3://{bucket}/in/*.parquet"\noutput = "s3://{bucket}/out"\n'
        f'target = "{model}"\nquiet = true\n'
        + "".join(f"{key} = {value!r}\n".replace("'", '"') for key, value in settings.items())
    )
    return job


def claims_in(fs: pafs.FileSystem, prefix: str) -> list[str]:
    """The claim objects in an output's bucket (its own and its workers' chunk claims)."""
    return [name for name in names(fs, prefix) if name.endswith(".claim")]


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def assert_one_line_error(result: Result, message: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchrun: error: "), result.stderr
    assert message in lines[0], lines[0]


def test_inputs_are_listed_as_local_ones(endpoint: str, bucket: str) -> None:
    """A file, a prefix and globs name the same files as they would locally; names starting
    with '.' or '_' and a batchrun output below the prefix are left out."""
    fs = s3(endpoint)
    put_prompts(fs, f"{bucket}/data", PROMPTS, files=3)
    put_prompts(fs, f"{bucket}/data/deeper", PROMPTS[:2], files=1)
    put_prompts(fs, f"{bucket}/data/_hidden", PROMPTS[:2], files=1)
    put_prompts(fs, f"{bucket}/data/old_run", PROMPTS[:2], files=1)
    fs.move(f"{bucket}/data/old_run/0.parquet", f"{bucket}/data/old_run/part-000000.parquet")
    with fs.open_output_stream(f"{bucket}/data/old_run/_progress/job.json") as stream:
        stream.write(b"{}")

    def listed(spec: str) -> list[str]:
        return [file.shown for file in open_input(spec).files]

    top = [f"s3://{bucket}/data/{n}.parquet" for n in range(3)]
    deeper = f"s3://{bucket}/data/deeper/0.parquet"
    assert listed(f"s3://{bucket}/data") == [*top, deeper]
    assert listed(f"s3://{bucket}/data/") == [*top, deeper]
    assert listed(f"s3://{bucket}/data/*.parquet") == top
    hidden = f"s3://{bucket}/data/_hidden/0.parquet"  # a glob names what it matches
    assert listed(f"s3://{bucket}/data/**/0.parquet") == [top[0], hidden, deeper]
    assert listed(top[1]) == [top[1]]
    source = open_input(f"s3://{bucket}/data/*.parquet")
    assert source.total_rows == len(PROMPTS)
    assert [f.row_group_rows for f in source.files] == [(3, 1), (3, 1), (3, 1)]
    with pytest.raises(JobError, match="matches no files"):
        open_input(f"s3://{bucket}/data/*.csv")
    with pytest.raises(JobError, match="does not exist"):
        open_input(f"s3://{bucket}/nothing-here")
    with pytest.raises(JobError, match="inside the output directory"):
        open_input(top[0], exclude=f"s3://{bucket}/data")


def test_one_listing_names_the_same_files_in_either_store(
    endpoint: str, bucket: str, tmp_path: Path
) -> None:
    """The same tree, on a local disk and in a bucket, lists the same files through the one
    listing (batchrun.io.input.listing over batchrun.io.store): a directory, a glob, '**', a
    file, an excluded output, hidden names and a nested batchrun output."""
    fs, local = s3(endpoint), pafs.LocalFileSystem()
    (tmp_path / "t").mkdir()
    trees = (
        (fs, f"{bucket}/t", f"s3://{bucket}/t"),
        (local, str(tmp_path / "t"), str(tmp_path / "t")),
    )
    for filesystem, root, _ in trees:
        for folder in ("data", "data/deeper", "data/_hidden", "data/old", "data/out"):
            if filesystem is local:
                Path(root, folder).mkdir(parents=True, exist_ok=True)
            put_prompts(filesystem, f"{root}/{folder}", PROMPTS[:2], files=1)
        filesystem.move(f"{root}/data/old/0.parquet", f"{root}/data/old/part-000000.parquet")
        filesystem.create_dir(f"{root}/data/old/_progress")
        with filesystem.open_output_stream(f"{root}/data/old/_progress/job.json") as stream:
            stream.write(b"{}")
    (tmp_path / "t/data/folder.parquet").mkdir()  # a directory is never an input file

    def listed(spec: str, exclude: str | None = None) -> list[list[str]]:
        lists = []
        for _, _, root in trees:
            paths = resolve_input_paths(
                f"{root}/{spec}", None if exclude is None else f"{root}/{exclude}"
            )
            lists.append([str(p).split("/t/", 1)[1] for p in paths])
        return lists

    every = ["data/0.parquet", "data/deeper/0.parquet", "data/out/0.parquet"]
    assert listed("data") == [every, every]
    assert listed("data", exclude="data/out") == [every[:2], every[:2]]
    assert listed("data/*/0.parquet") == [["data/_hidden/0.parquet", *every[1:]]] * 2
    below = ["data/0.parquet", "data/_hidden/0.parquet", "data/deeper/0.parquet"]
    assert listed("data/**/0.parquet", exclude="data/out") == [below, below]
    assert listed("data/old/part-000000.parquet") == [["data/old/part-000000.parquet"]] * 2
    refused = {
        ("data/out/0.parquet", "data/out"): "input file .* is inside the output directory",
        ("data/*.csv", "data/out"): "matches no files",
        ("data/out", "data/out"): "input directory .* is the output directory",
        ("data/out/", "data/out"): "input directory .* is the output directory",
        ("data/deeper", "data"): "input directory .* is inside the output directory",
        ("data/out/*.parquet", "data/out"): "matches only files inside the output directory",
    }
    for (spec, exclude), message in refused.items():
        for _, _, root in trees:
            with pytest.raises(JobError, match=message):
                resolve_input_paths(f"{root}/{spec}", f"{root}/{exclude}")


def test_a_job_on_s3_writes_every_row_once_and_a_second_run_adds_nothing(
    tmp_path: Path, tiny_model: Path, endpoint: str, bucket: str
) -> None:
    fs = s3(endpoint)
    put_prompts(fs, f"{bucket}/in", PROMPTS)
    job = write_job(tmp_path, tiny_model, bucket, claims_dir="claims")  # still an option
    local_input = tmp_path / "local-in"
    local_input.mkdir()
    for name in ("0.parquet", "1.parquet"):
        with fs.open_input_file(f"{bucket}/in/{name}") as source:
            (local_input / name).write_bytes(source.read())

    first = invoke("run", str(job))
    assert first.exit_code == 0, first.output
    assert f"-> s3://{bucket}/out" in first.stdout
    written = names(fs, f"{bucket}/out")
    assert "_SUCCESS" in written and "stats.json" in written and "_progress/job.json" in written
    assert not [n for n in written if n.endswith(".tmp")]  # no temps: objects appear whole
    output = read_parts(fs, f"{bucket}/out")
    assert output.column("row_index").to_pylist() == list(range(len(PROMPTS)))
    assert output.column("number").to_pylist() == list(range(len(PROMPTS)))
    assert list((tmp_path / "claims").iterdir())  # the claims lived here...
    assert not list((tmp_path / "claims").glob("*/_claims/*.claim"))  # ...and were released
    assert not [n for n in written if n.startswith("_claims/")]  # not in the bucket

    # The same rows as the same job on local files.
    local = invoke("run", str(job), "--input", str(local_input), "--output", str(tmp_path / "o"))
    assert local.exit_code == 0, local.output
    parts = sorted((tmp_path / "o").glob("part-*.parquet"))
    expected = pa.concat_tables(pq.read_table(p) for p in parts).sort_by("row_index")
    for column in ("completion", "completion_token_ids", "finish_reason", "error"):
        assert output.column(column).equals(expected.column(column)), column

    second = invoke("run", str(job))
    assert second.exit_code == 0, second.output
    assert names(fs, f"{bucket}/out") == written  # nothing added

    summary = invoke("stats", f"s3://{bucket}/out")
    assert summary.exit_code == 0, summary.output
    assert f"rows: {len(PROMPTS)} (" in summary.stdout and "complete)" in summary.stdout
    exported: dict[str, list[str]] = {}
    for name, out_dir in (("s3", f"s3://{bucket}/out"), ("local", str(tmp_path / "o"))):
        results = tmp_path / f"{name}.jsonl"
        ran = invoke("export", out_dir, "--output", str(results))
        assert ran.exit_code == 0 and f"{len(PROMPTS)} results" in ran.stdout, ran.output
        lines = [json.loads(line) for line in results.read_text().splitlines()]
        for line in lines:
            if line["response"] is not None:
                line["response"]["body"].pop("created")  # when the part was written
        exported[name] = sorted(json.dumps(line, sort_keys=True) for line in lines)
    assert exported["s3"] == exported["local"]  # the same results as the same job's local output
    report = invoke("report", f"s3://{bucket}/out")
    assert report.exit_code == 0, report.output
    assert "report.html" in names(fs, f"{bucket}/out")

    # A damaged part is moved aside (a copy and a delete: no rename) and its rows redone.
    first_part = next(n for n in written if n.startswith("part-"))
    with fs.open_output_stream(f"{bucket}/out/{first_part}") as stream:
        stream.write(b"not parquet")
    repaired = invoke("run", str(job))
    assert repaired.exit_code == 0, repaired.output
    assert "1 damaged part(s) moved" in repaired.stderr
    assert f"_progress/damaged/{first_part}" in names(fs, f"{bucket}/out")
    rows = read_parts(fs, f"{bucket}/out").column("row_index").to_pylist()
    assert rows == list(range(len(PROMPTS)))

    overwritten = invoke("run", str(job), "--overwrite", "--max-tokens", "3")
    assert overwritten.exit_code == 0, overwritten.output
    output = read_parts(fs, f"{bucket}/out")
    assert output.column("row_index").to_pylist() == list(range(len(PROMPTS)))
    assert max(output.column("completion_tokens").to_pylist()) <= 3


def _part_count(fs: pafs.FileSystem, prefix: str) -> int:
    return sum(name.startswith("part-") for name in names(fs, prefix))


def test_a_killed_job_on_s3_resumes_losing_and_repeating_nothing(
    tmp_path: Path, tiny_model: Path, endpoint: str, bucket: str
) -> None:
    fs = s3(endpoint)
    prompts = [f"class Model{i}:\n    def forward(self, x):" for i in range(12)]
    put_prompts(fs, f"{bucket}/in", prompts)
    job = write_job(tmp_path, tiny_model, bucket, rows_per_part=2, max_batch_size=2)
    process = subprocess.Popen(
        [sys.executable, "-m", "batchrun.cli", "run", str(job)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while process.poll() is None and time.monotonic() < deadline:
            if _part_count(fs, f"{bucket}/out") >= 1:
                os.kill(process.pid, signal.SIGKILL)
                break
            time.sleep(0.01)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    assert process.returncode == -signal.SIGKILL, "the job finished before it could be killed"
    committed = read_parts(fs, f"{bucket}/out").column("row_index").to_pylist()
    assert len(committed) == len(set(committed)) < len(prompts)  # nothing twice, work left
    assert "_SUCCESS" not in names(fs, f"{bucket}/out")
    left = claims_in(fs, f"{bucket}/out")
    assert len(left) == 1 and left[0].startswith("_claims/")  # the killed run's, in the bucket

    resumed = invoke("run", str(job))  # the killed run's claim is stale: taken over
    assert resumed.exit_code == 0, resumed.output
    output = read_parts(fs, f"{bucket}/out")
    assert output.column("row_index").to_pylist() == list(range(len(prompts)))
    assert "_SUCCESS" in names(fs, f"{bucket}/out")
    assert not claims_in(fs, f"{bucket}/out")  # the stale claim deleted, the new one released


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("unreachable endpoint", "cannot connect to the object store at http://127.0.0.1:"),
        ("no credentials", "no AWS credentials found"),
        ("no input bucket", "bucket 'no-such-bucket-here' does not exist"),
        ("no output bucket", "bucket 'no-such-bucket-here' does not exist"),
        ("no boto3", "through boto3, which is not installed: pip install 'batchrun[s3]'"),
        ("claims_dir under a file", "claims_dir"),
    ],
)
def test_bad_object_storage_is_one_line(
    tmp_path: Path,
    tiny_model: Path,
    endpoint: str,
    bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    message: str,
) -> None:
    put_prompts(s3(endpoint), f"{bucket}/in", PROMPTS)
    job = write_job(tmp_path, tiny_model, bucket)
    flags: list[str] = []
    if case == "unreachable endpoint":
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")
    elif case == "no credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    elif case == "no input bucket":
        flags = ["--input", "s3://no-such-bucket-here/in/*.parquet"]
    elif case == "no output bucket":
        flags = ["--output", "s3://no-such-bucket-here/out"]
    elif case == "no boto3":
        monkeypatch.setitem(sys.modules, "boto3", None)  # as if not installed
    else:
        (tmp_path / "a-file").write_text("")
        flags = ["--claims-dir", str(tmp_path / "a-file" / "claims")]
        message = f"claims_dir {str(tmp_path / 'a-file' / 'claims')!r} cannot be made: "
        message += f"{str(tmp_path / 'a-file')!r} is not a directory"
    assert_one_line_error(invoke("run", str(job), *flags), message)
    assert_one_line_error(invoke("validate", str(job), *flags), message)


def test_model_directories_stay_local(tmp_path: Path, tiny_model: Path, bucket: str) -> None:
    job = write_job(tmp_path, tiny_model, bucket)
    result = invoke("run", str(job), "--target", f"s3://{bucket}/model")
    assert_one_line_error(result, "only input and output may be in object storage")


def test_pyarrow_still_writes_no_object_conditionally(endpoint: str, bucket: str) -> None:
    """Why claims in a bucket go through boto3 (batchrun.io.output.bucket_claims): pyarrow
    sends no If-None-Match, so a create-if-absent write replaces what is there (the server itself
    honours the header). When this fails, a pyarrow release has it, and boto3 can go."""
    client = boto3.client("s3", endpoint_url=endpoint)
    client.put_object(Bucket=bucket, Key="claim", Body=b"first")
    with pytest.raises(client.exceptions.ClientError, match="PreconditionFailed"):
        client.put_object(Bucket=bucket, Key="claim", Body=b"second", IfNoneMatch="*")
    with s3(endpoint).open_output_stream(f"{bucket}/claim", metadata={"If-None-Match": "*"}) as out:
        out.write(b"third")
    assert client.get_object(Bucket=bucket, Key="claim")["Body"].read() == b"third"


def test_ray_runs_refuse_object_storage(tmp_path: Path, tiny_model: Path, bucket: str) -> None:
    job = write_job(tmp_path, tiny_model, bucket)
    assert_one_line_error(invoke("run", str(job), "--ray"), "--ray reads and writes local")


def test_shards_share_an_s3_output(
    tmp_path: Path, tiny_model: Path, endpoint: str, bucket: str
) -> None:
    """Two processes at once, with nothing but the bucket between them (no claims_dir): each
    claims its shard in the bucket, and every row is written exactly once."""
    fs = s3(endpoint)
    put_prompts(fs, f"{bucket}/in", PROMPTS)
    job = write_job(tmp_path, tiny_model, bucket)
    checked = invoke("validate", str(job), "--shard", "0/2")  # no claims_dir: nothing missing
    assert checked.exit_code == 0, checked.output
    shards = [
        subprocess.Popen(
            [sys.executable, "-m", "batchrun.cli", "run", str(job), "--shard", shard],
            cwd=tmp_path,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stderr=subprocess.PIPE,
            text=True,
        )
        for shard in ("0/2", "1/2")
    ]
    for process in shards:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr
    assert not claims_in(fs, f"{bucket}/out")  # both released
    output = read_parts(fs, f"{bucket}/out")
    assert output.column("row_index").to_pylist() == list(range(len(PROMPTS)))
    written = names(fs, f"{bucket}/out")
    assert "_SUCCESS" in written and "_progress/stats-00001-of-00002.json" in written
    with fs.open_input_stream(f"{bucket}/out/stats.json") as stream:
        assert json.loads(stream.read())["rows"] == len(PROMPTS)  # job-wide, by the last shard

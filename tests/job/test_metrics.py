"""Live metrics: a running job scraped over HTTP at steps the test holds it at, its textfile, and
the one-line refusals of a port in use and a file that cannot be written."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchrun.config.job import JobSpec
from batchrun.engine.core.requests import Request
from batchrun.errors import JobError
from batchrun.runners import metrics
from batchrun.runners.engine_feed import EngineLike, build_engine
from batchrun.runners.local import run_job
from batchrun.runners.metrics import MetricsPlan
from batchrun.tools.tiny_draft import make_tiny_draft
from tests.job.test_cli import assert_one_line_error, invoke, write_job, write_prompts

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

PROMPTS = [f"def step_{i}(state):" for i in range(9)] + [None]  # the last: an error row
WAIT_SECONDS = 120  # a generous bound on a tiny model's steps; only a hang reaches it

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def parse(text: str) -> Samples:
    """Every sample of Prometheus text, by name and sorted labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return parse(response.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"worker": "0", **labels}.items())))]


class GatedEngine:
    """The real engine, held inside its step number `at` of each gate until the test lets it
    go on: the run loop is blocked there, so what is scraped is what it published before."""

    def __init__(self, engine: EngineLike, gates: tuple[int, ...]) -> None:
        self.engine, self.steps = engine, 0
        self.gates = {at: (threading.Event(), threading.Event()) for at in gates}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add(self, request: Request) -> None:
        self.engine.add(request)

    def step(self) -> list[Request]:
        self.steps += 1
        if self.steps in self.gates:
            reached, go_on = self.gates[self.steps]
            reached.set()
            go_on.wait(WAIT_SECONDS)
        return self.engine.step()

    def held_at(self, step: int) -> None:
        assert self.gates[step][0].wait(WAIT_SECONDS), f"the job never reached step {step}"

    def release(self, step: int) -> None:
        self.gates[step][1].set()

    def release_all(self) -> None:
        for _, go_on in self.gates.values():
            go_on.set()


@pytest.fixture
def refresh_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine-side figures published after every step, the textfile rewritten often, so that
    what a held job shows is exactly where it stands."""
    monkeypatch.setattr(metrics, "REFRESH_SECONDS", 0.0)
    monkeypatch.setattr(metrics, "FILE_SECONDS", 0.05)


@pytest.fixture
def job_thread() -> Iterator[list[threading.Thread]]:
    threads: list[threading.Thread] = []
    yield threads
    for thread in threads:
        thread.join(WAIT_SECONDS)


def test_a_running_job_is_scraped_and_its_counters_move(
    tmp_path: Path,
    tiny_model: Path,
    refresh_every_step: None,
    job_thread: list[threading.Thread],
) -> None:
    draft = make_tiny_draft(tmp_path / "draft", tiny_model, block_size=4)
    write_prompts(tmp_path / "in", PROMPTS)
    port, textfile = free_port(), tmp_path / "batchrun.prom"
    job = JobSpec.from_keys(
        dict(
            input=str(tmp_path / "in"),
            output=str(tmp_path / "out"),
            target=str(tiny_model),
            draft=str(draft),
            verify_width="full",
            max_tokens=8,
            ignore_eos=True,
            max_batch_size=2,
            rows_per_part=4,
            quiet=True,
            metrics_port=port,
            metrics_file=str(textfile),
        )
    )
    engine = GatedEngine(build_engine(job), gates=(3, 12))
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["stats"] = run_job(job, engine)
        except BaseException as exc:  # handed to the test's thread
            outcome["error"] = exc

    job_thread.append(threading.Thread(target=run, name="job"))
    job_thread[0].start()
    try:
        engine.held_at(3)
        early = scrape(port)
        assert value(early, "batchrun_input_rows") == len(PROMPTS)
        assert value(early, "batchrun_steps_total", kind="prefill") >= 1
        assert value(early, "batchrun_kv_pages_total") > 0
        assert value(early, "batchrun_kv_pages_used") > 0  # two rows hold pages mid-step
        assert parse(textfile.read_text())  # written at the start, before any row
        engine.release(3)

        engine.held_at(12)
        later = scrape(port)
        for name in ("batchrun_rows_total", "batchrun_completion_tokens_total"):
            assert value(later, name) > value(early, name), name
        steps = ("batchrun_steps_total", {"kind": "decode"})
        assert value(later, steps[0], **steps[1]) > value(early, steps[0], **steps[1])
        assert value(later, "batchrun_verify_width_steps_total", width="4") > 0
        assert value(later, "batchrun_spec_rounds_total") > 0
        assert 1 <= value(later, "batchrun_acceptance_length") <= 4
        assert value(later, "batchrun_output_tokens_per_second") > 0
        rows = value(later, "batchrun_rows_total")
        deadline = time.monotonic() + WAIT_SECONDS  # the textfile catches up within FILE_SECONDS
        while value(parse(textfile.read_text()), "batchrun_rows_total") < rows:
            assert time.monotonic() < deadline, "the textfile was not rewritten"
            time.sleep(0.01)
    finally:
        engine.release_all()
    job_thread[0].join(WAIT_SECONDS)
    assert "error" not in outcome, outcome.get("error")

    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["rows"] == outcome["stats"]["rows"]
    final = parse(textfile.read_text())  # written once more at the end
    assert value(final, "batchrun_rows_total") == stats["rows"] == len(PROMPTS)
    assert value(final, "batchrun_error_rows_total") == stats["error_rows"] == 1
    assert value(final, "batchrun_prompt_tokens_total") == stats["prompt_tokens"]
    assert value(final, "batchrun_completion_tokens_total") == stats["completion_tokens"]
    assert value(final, "batchrun_input_rows_done") == len(PROMPTS)
    assert value(final, "batchrun_kv_pages_used") == 0  # every row finished: no page held
    steps_by_kind = {k: value(final, "batchrun_steps_total", kind=k) for k in stats["steps"]}
    assert steps_by_kind == stats["steps"]
    widths = stats["verify_width_steps"]
    assert {w: value(final, "batchrun_verify_width_steps_total", width=w) for w in widths} == {
        w: float(n) for w, n in widths.items()
    }
    assert value(final, "batchrun_acceptance_length") == pytest.approx(stats["acceptance_length"])
    with pytest.raises(OSError):  # the server stopped with the job
        scrape(port)


def test_the_textfile_of_a_cli_run_holds_its_stats(tmp_path: Path, tiny_model: Path) -> None:
    write_prompts(tmp_path / "in", PROMPTS)
    job = write_job(tmp_path, tiny_model, extra='metrics_file = "metrics/run.prom"\n')
    result = invoke("run", str(job))  # relative to the job file; its directory is made
    assert result.exit_code == 0, result.output
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    final = parse((tmp_path / "metrics" / "run.prom").read_text())
    assert value(final, "batchrun_rows_total") == stats["rows"]
    assert value(final, "batchrun_error_rows_total") == stats["error_rows"]
    assert value(final, "batchrun_completion_tokens_total") == stats["completion_tokens"]
    # Without a drafter, no speculation series.
    assert not any(name.startswith("batchrun_spec_") for name, _ in final)
    assert not list((tmp_path / "metrics").glob("*.prom.*"))  # no temp file left behind


def test_a_port_in_use_stops_the_job_before_it_starts(tmp_path: Path, tiny_model: Path) -> None:
    write_prompts(tmp_path / "in", PROMPTS)
    job = write_job(tmp_path, tiny_model)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = invoke("run", str(job), "--metrics-port", port)
    assert_one_line_error(result, f"metrics port {port} on 127.0.0.1 is in use")
    assert not (tmp_path / "out").exists()


def test_a_metrics_file_that_cannot_be_written_stops_the_job(
    tmp_path: Path, tiny_model: Path
) -> None:
    write_prompts(tmp_path / "in", PROMPTS)
    job = write_job(tmp_path, tiny_model)
    (tmp_path / "a-file").write_text("")
    unwritable = tmp_path / "a-file" / "run.prom"  # under a file: not even root can write it
    result = invoke("run", str(job), "--metrics-file", str(unwritable))
    assert_one_line_error(result, f"metrics file '{unwritable}' cannot be written")
    assert not (tmp_path / "out").exists()


def test_each_shard_has_its_own_worker_label_port_and_file(tmp_path: Path) -> None:
    keys = dict(input="in", output="out", target="model", metrics_port=9400)
    assert MetricsPlan.of(JobSpec.from_keys(keys)) == MetricsPlan("0", "127.0.0.1", 9400, None)
    sharded = JobSpec.from_keys(
        {**keys, "shard": "3/4", "metrics_file": "m/b.prom", "metrics_host": "0.0.0.0"}
    )
    assert MetricsPlan.of(sharded) == MetricsPlan("3", "0.0.0.0", 9403, Path("m/b-3.prom"))
    assert MetricsPlan.of(sharded, worker=1) == MetricsPlan(
        "1", "0.0.0.0", 9401, Path("m/b-1.prom")
    )
    assert MetricsPlan.of(JobSpec.from_keys({**keys, "metrics_port": None})) is None
    with pytest.raises(JobError, match="above 65535"):
        MetricsPlan.of(JobSpec.from_keys({**keys, "metrics_port": 65535, "shard": "1/2"}))


def test_ray_runs_refuse_the_metrics_options(tmp_path: Path) -> None:
    """A Ray run's engines live in its actors: it refuses rather than serve empty metrics."""
    pytest.importorskip("ray")
    from batchrun.runners.ray.run import run_job_ray

    keys = dict(input="in", output="out", target="model")
    for extra in ({"metrics_port": 9400}, {"metrics_file": str(tmp_path / "m.prom")}):
        with pytest.raises(JobError, match="a local run's"):
            run_job_ray(JobSpec.from_keys({**keys, **extra}))

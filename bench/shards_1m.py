"""Shards over a large input: peak memory per shard and input bytes read by all shards together.

    python bench/shards_1m.py                       # 1,000,000 rows, 4 shards, 2 at a time
    python bench/shards_1m.py --rows 100000 --out bench/results/shards-100k-cpu.json

Writes a Parquet input of short prompts (several files, many row groups), makes the tiny random
model if it is missing (`python -m batchrun.tools.tiny models/tiny`), and runs
`batchrun run --shard I/N --max-tokens 1` as one process per shard, a few at a time. Each shard
runs under a wrapper that counts the bytes read from the input files: through every Parquet file
pyarrow opens (row groups) and every footer batchrun reads; its peak RSS comes from wait4(). The
output must be complete (_SUCCESS, every row_index exactly once). Targets: peak RSS < 2 GB per
shard, bytes read by all shards <= 1.2x the input's size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
COUNTER = Path(__file__).resolve().parent / "read_counter.py"


def write_input(directory: Path, rows: int, files: int, row_group_rows: int) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-rows // files)
    paths = []
    for number in range(files):
        start, stop = number * per_file, min(rows, (number + 1) * per_file)
        ids = pa.array(range(start, stop), pa.int64())
        prompts = pa.array([f"def task_{i}(item):" for i in range(start, stop)], pa.string())
        path = directory / f"prompts-{number:03d}.parquet"
        pq.write_table(
            pa.table({"id": ids, "prompt": prompts}), path, row_group_size=row_group_rows
        )
        paths.append(path)
    return paths


def ensure_model(model: Path) -> None:
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "batchrun.tools.tiny", str(model)], check=True)


def run_shards(
    args: argparse.Namespace, input_dir: Path, output: Path, model: Path, counts: Path
) -> list[dict[str, Any]]:
    """Every shard, `parallel` at a time; each one's wall time, peak RSS and read counts."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(args.code)}
    flags = ["--input", str(input_dir), "--output", str(output), "--target", str(model)]
    flags += ["--max-tokens", "1", "--max-batch-size", str(args.max_batch_size), "--quiet"]
    flags += ["--rows-per-part", str(args.rows_per_part), "--dtype", "float32", "--device", "cpu"]
    waiting = list(range(args.shards))
    running: dict[int, tuple[int, float, subprocess.Popen[bytes]]] = {}
    results: dict[int, dict[str, Any]] = {}
    while waiting or running:
        while waiting and len(running) < args.parallel:
            index = waiting.pop(0)
            counted = counts / f"shard-{index}.json"
            cmd = [sys.executable, str(COUNTER), str(counted), str(input_dir), "run"]
            cmd += [*flags, "--shard", f"{index}/{args.shards}"]
            process = subprocess.Popen(cmd, env=env, cwd=REPO)
            running[process.pid] = (index, time.monotonic(), process)
        pid, status, usage = os.wait4(-1, 0)
        if pid not in running:
            continue
        index, started, process = running.pop(pid)
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            raise SystemExit(f"shard {index} exited {process.returncode}")
        counted = json.loads((counts / f"shard-{index}.json").read_text())
        stats = json.loads(
            (output / "_progress" / f"stats-{index:05d}-of-{args.shards:05d}.json").read_text()
        )
        results[index] = {
            "shard": f"{index}/{args.shards}",
            "rows": stats["rows"],
            "wall_seconds": round(time.monotonic() - started, 2),
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),  # Linux: KiB
            **counted,
        }
        print(f"shard {index}: {json.dumps(results[index])}", file=sys.stderr)
    return [results[index] for index in range(args.shards)]


def check_output(output: Path, rows: int) -> None:
    assert (output / "_SUCCESS").exists(), "no _SUCCESS"
    indices = pa.concat_arrays(
        [
            pq.read_table(part, columns=["row_index"]).column("row_index").combine_chunks()
            for part in sorted(output.glob("part-*.parquet"))
        ]
    )
    assert len(indices) == rows, (len(indices), rows)
    assert pa.compute.count_distinct(indices).as_py() == rows, "a row twice"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--files", type=int, default=6)
    parser.add_argument("--row-group-rows", type=int, default=10_000)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--parallel", type=int, default=2, help="shards running at once")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--rows-per-part", type=int, default=10_000)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny")
    parser.add_argument("--work", type=Path, default=Path("/tmp/batchrun-bench-shards"))
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/shards-1m-cpu.json")
    parser.add_argument(
        "--code", type=Path, default=REPO, help="the checkout whose batchrun the shards run"
    )
    args = parser.parse_args()

    ensure_model(args.model)
    work = args.work / f"rows-{args.rows}-files-{args.files}-groups-of-{args.row_group_rows}"
    input_dir, output, counts = work / "in", work / "out", work / "counts"
    if not input_dir.exists():
        write_input(input_dir, args.rows, args.files, args.row_group_rows)
    paths = sorted(input_dir.glob("*.parquet"))
    subprocess.run(["rm", "-rf", str(output), str(counts)], check=True)
    counts.mkdir(parents=True)

    began = time.monotonic()
    shards = run_shards(args, input_dir, output, args.model, counts)
    wall = time.monotonic() - began
    check_output(output, args.rows)

    input_bytes = sum(path.stat().st_size for path in paths)
    read = sum(int(shard["input_bytes_read"]) for shard in shards)
    peak = max(float(shard["peak_rss_mb"]) for shard in shards)
    groups = sum(pq.read_metadata(path).num_row_groups for path in paths)
    commit = subprocess.run(
        ["git", "-C", str(args.code), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    result = {
        "what": "batchrun run --shard I/N over one input, max_tokens 1, tiny random model, CPU",
        "commit": commit,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "rows": args.rows,
        "files": len(paths),
        "row_groups": groups,
        "input_bytes": input_bytes,
        "shards": args.shards,
        "parallel": args.parallel,
        "max_batch_size": args.max_batch_size,
        "rows_per_part": args.rows_per_part,
        "wall_seconds": round(wall, 1),
        "rows_per_second": round(args.rows / wall, 1),
        "max_peak_rss_mb": peak,
        "input_bytes_read_all_shards": read,
        "read_ratio": round(read / input_bytes, 4),
        "targets": {"peak_rss_mb_below": 2048, "read_ratio_at_most": 1.2},
        "targets_met": peak < 2048 and read / input_bytes <= 1.2,
        "per_shard": shards,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_shard"}, indent=2))


if __name__ == "__main__":
    main()

"""Run a batchrun command, counting the bytes it reads from the input files (bench/shards_1m.py).

    python bench/read_counter.py COUNTS.json INPUT_DIR run JOB.toml --shard 0/4 ...

Counted: every read from a Parquet file under INPUT_DIR that pyarrow opens (the row groups read;
open_input parses footers from bytes without opening the files through pyarrow, where batchrun
before whole-row-group shards opened each file, reading its last 64 KiB) and every footer
batchrun reads itself (parquet_footer: the 8-byte tail and the footer). At
exit COUNTS.json gets those counts and this process's /proc/self/io (which also counts imports,
model files and everything else the process reads, for comparison).
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from batchrun.cli import cli
from batchrun.io.input import reader
from batchrun.io.output import fingerprint

counts = {"pyarrow_bytes_read": 0, "footer_bytes_read": 0, "files_opened": 0, "row_groups": 0}


class CountingFile(io.RawIOBase):
    def __init__(self, path: Path) -> None:
        self.file = path.open("rb", buffering=0)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()

    def readinto(self, buffer: Any) -> int:
        count = self.file.readinto(buffer)
        counts["pyarrow_bytes_read"] += count or 0
        return count or 0

    def close(self) -> None:
        self.file.close()
        super().close()


def main() -> None:
    counts_path, input_dir = Path(sys.argv[1]), Path(sys.argv[2]).resolve()

    class CountedParquetFile(pq.ParquetFile):
        def __init__(self, source: Any, **kwargs: Any) -> None:
            if isinstance(source, (str, Path)) and Path(source).resolve().is_relative_to(input_dir):
                counts["files_opened"] += 1
                source = CountingFile(Path(source))
            super().__init__(source, **kwargs)

        def iter_batches(self, *args: Any, **kwargs: Any) -> Any:
            counts["row_groups"] += len(kwargs.get("row_groups") or [])
            return super().iter_batches(*args, **kwargs)

    # Where batchrun reads footers itself (before these shards: only the fingerprint did).
    module = reader if hasattr(reader, "parquet_footer") else fingerprint
    footer = getattr(module, "parquet_footer")  # noqa: B009 (the other module has none)

    def counted_footer(path: Path) -> bytes:
        data = footer(path)
        counts["footer_bytes_read"] += 8 + len(data)
        return data

    pq.ParquetFile = CountedParquetFile
    setattr(module, "parquet_footer", counted_footer)  # noqa: B010
    try:
        cli.main(args=sys.argv[3:], prog_name="batchrun")
    finally:
        proc = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        result = {
            "input_bytes_read": counts["pyarrow_bytes_read"] + counts["footer_bytes_read"],
            **counts,
            "proc_rchar": int(proc["rchar"]),
            "proc_read_bytes": int(proc["read_bytes"]),
        }
        counts_path.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()

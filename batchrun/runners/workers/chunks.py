"""The rows of a multi-worker job as chunks that its workers claim one at a time as they need rows.

Each row group of the input is cut into chunks of `size` rows from its start (the last one may be
shorter); every worker of a run plans the same chunks from the input's footers. A worker goes
through the chunks, its own share (worker I of N: the I-th N-th of them) front to back first,
then the others' from the back (what their owners reach last). For each chunk not known to be
done it tries a claim (batchrun.io.output.claim's try_claim, in a claim space of the chunk's own
beside the output's claims: a directory, or a prefix of an s3:// output's bucket). A chunk held
by a live worker is skipped; a claim of a worker that is gone is stale and taken over. Once it
holds a chunk, it looks again at which of its rows are committed (a worker killed mid-chunk
committed some) and reads the others. Claims are taken as
the worker's reader asks for rows (the worker keeps one chunk read ahead and a batch queued), so
a slow worker takes fewer chunks. Passes repeat while one claims something; a worker releases
its claims only when its rows are all committed (its run ended).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.errors import JobError
from batchrun.io.input.openai_batch import read_request_rows
from batchrun.io.input.reader import READ_BATCH_ROWS, InputBatch, InputFile, InputSource
from batchrun.io.output.claim import try_claim
from batchrun.io.output.claim_space import ClaimSpace
from batchrun.io.output.directory import OutputDir
from batchrun.io.store import ObjectLocation, storage_reason

CHUNKS_PER_WORKER = 8  # finer chunks balance slow and fast workers better, at more claims


@dataclass(frozen=True)
class Chunk:
    """Rows [start, stop) of row_index: rows [offset, offset + stop - start) of one row group."""

    file: int  # index into the source's files
    group: int
    offset: int
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"rows-{self.start}-{self.stop}"


def chunk_rows(total_rows: int, workers: int) -> int:
    """Rows per chunk: about CHUNKS_PER_WORKER chunks per worker, at most a read batch."""
    wanted = -(-total_rows // (workers * CHUNKS_PER_WORKER))
    return max(1, min(READ_BATCH_ROWS, wanted))


def plan_chunks(source: InputSource, size: int) -> list[Chunk]:
    """Every row group cut into chunks of `size` rows, in input order (empty groups: none)."""
    chunks = []
    for number, file in enumerate(source.files):
        start = file.first_row
        for group, rows in enumerate(file.row_group_rows):
            for offset in range(0, rows, size):
                stop = start + min(offset + size, rows)
                chunks.append(Chunk(number, group, offset, start + offset, stop))
            start += rows
    return chunks


def home_chunks(chunks: int, index: int, count: int) -> range:
    """Worker `index` of `count`'s own share of the chunks (by number): the index-th count-th."""
    return range(index * chunks // count, (index + 1) * chunks // count)


def home_share(chunks: list[Chunk], index: int, count: int, done: np.ndarray) -> tuple[int, int]:
    """The rows of worker `index`'s own chunks, and of those the rows `done` marks."""
    own = [chunks[n] for n in home_chunks(len(chunks), index, count)]
    return sum(c.stop - c.start for c in own), sum(int(done[c.start : c.stop].sum()) for c in own)


class CommittedRows:
    """Which rows have committed output: each part's rows are read once (parts never change)."""

    def __init__(self, out: OutputDir, total_rows: int) -> None:
        self.out = out
        self.mask = np.zeros(total_rows, dtype=bool)
        self._seen: set[str] = set()

    def refresh(self) -> np.ndarray:
        for part in self.out.committed_parts():
            if part.name in self._seen:
                continue
            try:
                ranges = self.out.part_row_ranges(part)
            except FileNotFoundError:
                continue
            for start, stop in ranges:
                self.mask[max(start, 0) : max(stop, 0)] = True
            self._seen.add(part.name)
        return self.mask


class _GroupReader:
    """Reads chunks of row groups, going on from where the last chunk ended when the next one
    follows it in the same group (a worker's chunks mostly do): each group is decoded about once."""

    def __init__(self, source: InputSource, size: int) -> None:
        self.source, self.size = source, size
        self._at: tuple[int, int] | None = None  # (file, group) of the open iterator
        self._batches: Iterator[pa.RecordBatch] = iter(())
        self._position = 0  # of the group's first row not yet taken from _batches
        self._held: pa.RecordBatch | None = None  # rows from _position, read but not taken
        self._readers: dict[int, pq.ParquetFile] = {}

    def read(self, chunk: Chunk) -> Iterator[tuple[int, pa.RecordBatch]]:
        """The chunk's rows as (offset in the group, batch) pieces."""
        if self._at != (chunk.file, chunk.group) or chunk.offset < self._position:
            self._open(chunk)
        end = chunk.offset + chunk.stop - chunk.start
        while self._position < end:
            batch = self._held if self._held is not None else next(self._batches, None)
            self._held = None
            if batch is None:
                return
            first, last = self._position, self._position + batch.num_rows
            if last <= chunk.offset:
                self._position = last
                continue
            skip = max(chunk.offset - first, 0)
            take = min(last, end) - first - skip
            yield first + skip, batch.slice(skip, take)
            if first + skip + take < last:  # the rest belongs to the chunks after this one
                self._held = batch.slice(skip + take)
            self._position = first + skip + take

    def _open(self, chunk: Chunk) -> None:
        file = self.source.files[chunk.file]
        self._at, self._position, self._held = (chunk.file, chunk.group), 0, None
        if file.requests is not None:
            self._batches = read_request_rows(
                Path(file.path), file.requests, chunk.group, self.size
            )
            return
        reader = self._readers.get(chunk.file)
        if reader is None:
            reader = pq.ParquetFile(file.store.open_input(file.path), metadata=file.metadata)
            self._readers = {chunk.file: reader}  # one open file at a time
        self._batches = reader.iter_batches(batch_size=self.size, row_groups=[chunk.group])


def _read_error(file: InputFile, exc: Exception) -> JobError:
    why = exc if file.store.local else storage_reason(exc, ObjectLocation.parse(file.shown))
    return JobError(f"cannot read input file {file.shown!r}: {why}")


class ChunkPuller:
    """One worker's input rows: the chunks it claims, see the module docstring. `done` is the
    run's done mask (its sink's), updated here as chunks are claimed."""

    def __init__(
        self,
        source: InputSource,
        out: OutputDir,
        chunks: list[Chunk],
        size: int,
        done: np.ndarray,
        worker: tuple[int, int],
    ) -> None:
        self.source, self.chunks, self.done = source, chunks, done
        self.committed = CommittedRows(out, source.total_rows)
        self.space = out.chunk_claims()
        home = home_chunks(len(chunks), *worker)
        # Its own share front to back, then the others' from the back: a fast worker takes
        # what their owners would reach last.
        self.order = [*home, *(n for n in reversed(range(len(chunks))) if n not in home)]
        self.reader = _GroupReader(source, size)
        # This worker's claim files (space, name), released once its run ended.
        self.held: list[tuple[ClaimSpace, str]] = []
        self.taken: set[int] = set()  # the chunks it holds

    def batches(self) -> Iterator[InputBatch]:
        """The rows of the chunks this worker claims, those committed already left out."""
        while True:
            claimed = False
            for number in self.order:
                chunk = self.chunks[number]
                if number in self.taken or self.done[chunk.start : chunk.stop].all():
                    continue
                if not self._claim(chunk):
                    continue
                self.taken.add(number)
                claimed = True
                yield from self._read(chunk)
            if not claimed:
                return

    def _claim(self, chunk: Chunk) -> bool:
        space = self.space.child(chunk.name)
        try:
            space.prepare()
            name = try_claim(space, (chunk.start, chunk.stop))
        except OSError as exc:
            raise JobError(f"cannot claim rows in {space.shown!r}: {exc.strerror or exc}") from exc
        if name is None:
            return False
        self.held.append((space, name))
        # Under the claim: the rows committed by now (by a worker killed mid-chunk, say).
        committed = self.committed.refresh()
        self.done[chunk.start : chunk.stop] |= committed[chunk.start : chunk.stop]
        return True

    def _read(self, chunk: Chunk) -> Iterator[InputBatch]:
        file = self.source.files[chunk.file]
        try:
            for offset, batch in self.reader.read(chunk):
                start = chunk.start + offset - chunk.offset
                indices = np.arange(start, start + batch.num_rows, dtype=np.int64)
                wanted = ~self.done[start : start + batch.num_rows]
                if wanted.any():
                    yield InputBatch(indices[wanted], batch.filter(pa.array(wanted)))
        except (OSError, pa.ArrowException) as exc:
            raise _read_error(file, exc) from exc

    def release(self) -> None:
        """Give up every claim (after the worker's rows are committed)."""
        for space, name in self.held:
            with contextlib.suppress(OSError):
                space.remove(name)
        self.held.clear()

"""A safetensors reader of our own, fast onto a GPU.

safe_open hands out CPU tensors over an mmap, and load_weights's copy of each to the GPU is then
a synchronous copy from pageable memory, staged by the driver, that faults the pages in as it
goes: a 16 GB checkpoint takes far longer than the page cache needs to hand it over. Here, for
a CUDA device, each file's data section is read in large chunks by several threads (os.preadv,
which releases the GIL) into a small ring of pinned buffers, each chunk copied asynchronously on
a side stream into one device buffer, and the tensors are typed views of that buffer. On the
CPU the data section is read with one call and the tensors are views of it (hundreds of tiny
test checkpoints stay fast).

The header is parsed and checked here: a damaged or hostile file raises JobError, one line.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import torch

from batchrun.errors import JobError

CHUNK_BYTES = 64 << 20  # large enough that each read and copy is efficient
THREADS = 4  # reads in flight, each into its own pinned buffer of the ring

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte range in the data section
    end: int


@dataclass(frozen=True)
class Header:
    data_start: int  # file offset of the data section
    data_bytes: int  # bytes of the data section the tensors span
    entries: list[Entry]  # in file (offset) order


def file_header(file: Path) -> Header:
    """The header of one file, read alone (no tensor data): what `validate` checks."""
    try:
        fd = os.open(file, os.O_RDONLY)
    except OSError as e:
        raise JobError(f"cannot read {file}: {e.strerror}") from None
    try:
        return read_header(fd, file)
    except OSError as e:
        raise JobError(f"cannot read {file}: {e.strerror}") from None
    finally:
        os.close(fd)


def read_header(fd: int, file: Path) -> Header:
    size = os.fstat(fd).st_size
    if size < 8:
        raise JobError(f"cannot read {file}: not a safetensors file ({size} bytes)")
    header_len = int.from_bytes(os.pread(fd, 8, 0), "little")
    if header_len > size - 8:
        raise JobError(
            f"cannot read {file}: header length {header_len} runs past the end of the file "
            f"({size} bytes)"
        )
    return parse_header(os.pread(fd, header_len, 8), size, file)


def parse_header(raw: bytes, file_size: int, file: Path) -> Header:
    """The header's tensors, checked against the file's size; raw is the JSON after the
    8-byte length."""
    data_start = 8 + len(raw)
    available = file_size - data_start
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError includes UnicodeDecodeError
        raise JobError(f"cannot read {file}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise JobError(f"cannot read {file}: header is not a JSON object")
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entry = _entry(name, info, available)
        if isinstance(entry, str):
            raise JobError(f"cannot read {file}: tensor {_short(name)}: {entry}")
        entries.append(entry)
    entries.sort(key=lambda e: (e.start, e.end))
    return Header(data_start, max((e.end for e in entries), default=0), entries)


def _entry(name: str, info: Any, available: int) -> Entry | str:
    """The tensor an entry describes, or what is wrong with it."""
    if not isinstance(info, dict):
        return "entry is not a JSON object"
    kind = info.get("dtype")
    dtype = DTYPES.get(kind) if isinstance(kind, str) else None
    if dtype is None:
        return f"unsupported dtype {_short(kind)}"
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not _ints(shape) or any(d < 0 for d in shape):
        return f"bad shape {_short(shape)}"
    if not _ints(offsets) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        return f"bad data_offsets {_short(offsets)}"
    start, end = offsets
    if end > available:
        return f"data_offsets {offsets} run past the end of the file ({available} data bytes)"
    if end - start != math.prod(shape) * dtype.itemsize:
        return f"{end - start} bytes for shape {_short(shape)} of {kind}"
    return Entry(name, dtype, tuple(shape), start, end)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _ints(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(v) is int for v in value)


def plan_chunks(length: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, size) of each chunk that covers length bytes."""
    return [(start, min(chunk_bytes, length - start)) for start in range(0, length, chunk_bytes)]


def read_safetensors(
    file: Path,
    device: torch.device | None = None,
    *,
    chunked: bool | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    threads: int = THREADS,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of each tensor of one file, in file order. On a CUDA device they are
    views of one device buffer of the file's data; otherwise CPU tensors, views of one buffer.
    chunked (default: on CUDA) reads through the threaded chunk ring; on the CPU that is only
    for tests of its arithmetic."""
    device = torch.device("cpu") if device is None or device.type != "cuda" else device
    try:
        fd = os.open(file, os.O_RDONLY)
    except OSError as e:
        raise JobError(f"cannot read {file}: {e.strerror}") from None
    try:
        header = read_header(fd, file)
        offset, length = header.data_start, header.data_bytes
        if chunked if chunked is not None else device.type == "cuda":
            data = _read_chunked(fd, offset, length, device, chunk_bytes, threads, file)
        else:
            data = torch.empty(length, dtype=torch.uint8)
            _pread_into(fd, data, offset, file)
    except OSError as e:
        raise JobError(f"cannot read {file}: {e.strerror}") from None
    finally:
        os.close(fd)
    last = len(header.entries) - 1
    for i, entry in enumerate(header.entries):
        raw = data[entry.start : entry.end]
        # A copy where view(dtype) refuses the offset (safetensors aligns its tensors), and of
        # the last tensor: a caller holds that one while it asks for the next file's, and data
        # is freed only once no tensor is a view of it.
        if entry.start % entry.dtype.itemsize or i == last:
            raw = raw.clone()
        yield entry.name, raw.view(entry.dtype).reshape(entry.shape)


def _pread_into(fd: int, buf: torch.Tensor, offset: int, file: Path) -> None:
    """Fill a contiguous uint8 CPU tensor from the file at offset."""
    view = buf.numpy().data.cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise JobError(f"cannot read {file}: the file ends before its data does")
        done += n


def _read_chunked(
    fd: int,
    offset: int,
    length: int,
    device: torch.device,
    chunk_bytes: int,
    threads: int,
    file: Path,
) -> torch.Tensor:
    """length bytes of the file from offset, in a uint8 tensor on device: worker threads read
    chunks into a ring of (on CUDA, pinned) buffers while the main thread copies the ones read
    to the device on a side stream. Every copy has finished when this returns."""
    out = torch.empty(length, dtype=torch.uint8, device=device)
    chunks = plan_chunks(length, chunk_bytes)
    if not chunks:
        return out
    cuda = device.type == "cuda"
    size = min(chunk_bytes, length)
    ring = [
        torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
        for _ in range(min(threads, len(chunks)))
    ]
    stream = torch.cuda.Stream(device) if cuda else None

    def fill(i: int, after: torch.cuda.Event | None) -> None:
        if after is not None:
            after.synchronize()  # the buffer's previous chunk has left it for the device
        start, n = chunks[i]
        _pread_into(fd, ring[i % len(ring)][:n], offset + start, file)

    try:
        if stream is not None:
            # out may reuse memory that queued work on the current stream still reads.
            stream.wait_stream(torch.cuda.current_stream(device))
        with ThreadPoolExecutor(len(ring)) as pool:
            pending: deque[Future[None]] = deque(
                pool.submit(fill, i, None) for i in range(len(ring))
            )
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for i, (start, n) in enumerate(chunks):
                    pending.popleft().result()
                    out[start : start + n].copy_(ring[i % len(ring)][:n], non_blocking=cuda)
                    if i + len(ring) < len(chunks):
                        copied = torch.cuda.Event() if cuda else None
                        if copied is not None:
                            copied.record(stream)
                        pending.append(pool.submit(fill, i + len(ring), copied))
    finally:
        if stream is not None:
            # Also on an error: out and the ring must not be freed under a running copy.
            stream.synchronize()
    return out

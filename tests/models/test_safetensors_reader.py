"""batchrun's safetensors reader reads what safetensors itself reads, through both of its paths
(the chunked, threaded one of the GPU run on the CPU too), and refuses damaged files with a
JobError."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from batchrun.errors import JobError
from batchrun.models.loader import iter_safetensors
from batchrun.models.safetensors_reader import DTYPES, plan_chunks, read_safetensors

# Odd sizes, so that chunk and tensor boundaries fall anywhere.
CHUNKED = [
    {"chunked": True, "chunk_bytes": c, "threads": t} for c, t in ((7, 3), (64, 2), (1000, 4))
]
PATHS = [{}, *CHUNKED]


def every_dtype() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i, dtype in enumerate(sorted(set(DTYPES.values()), key=str)):
        shape = [(3, 5), (7,), (2, 1, 3), (0, 4), ()][i % 5]
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=gen).to(dtype)
        else:  # random bytes: every bit pattern of the integer types, and 0/1 for bool
            t = torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8, generator=gen)
            t = (t & 1).bool().squeeze(-1) if dtype == torch.bool else t.view(dtype).squeeze(-1)
        out[f"t.{i}.{str(dtype).removeprefix('torch.')}"] = t
    return out


def reference(file: Path) -> list[tuple[str, torch.Tensor]]:
    """safetensors' own reading, in file order."""
    with safe_open(str(file), framework="pt") as f:
        return [(name, f.get_tensor(name)) for name in f.offset_keys()]


def assert_same(ours: list[tuple[str, torch.Tensor]], ref: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in ours] == [n for n, _ in ref]
    for (name, a), (_, b) in zip(ours, ref, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        # Compared as bytes: exact, NaN bit patterns included, for dtypes without equal().
        a, b = a.cpu().contiguous(), b.contiguous()
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name


def test_plan_chunks_cover_the_data_once() -> None:
    assert plan_chunks(0, 4) == []
    assert plan_chunks(4, 4) == [(0, 4)]
    assert plan_chunks(10, 4) == [(0, 4), (4, 4), (8, 2)]
    for length in range(0, 40):
        chunks = plan_chunks(length, 6)
        assert sum(n for _, n in chunks) == length
        assert all(a + n == b for (a, n), (b, _) in zip(chunks, chunks[1:], strict=False))


@pytest.mark.parametrize("path", PATHS)
def test_every_dtype_reads_as_safetensors_does(tmp_path: Path, path: dict) -> None:
    file = tmp_path / "model.safetensors"
    save_file(every_dtype(), str(file), metadata={"format": "pt"})
    assert_same(list(read_safetensors(file, **path)), reference(file))


def test_unaligned_offsets_read_too(tmp_path: Path) -> None:
    """A writer other than safetensors may leave a tensor at an offset its dtype does not
    divide (view(dtype) refuses those); the reader copies it then."""
    values = torch.arange(6, dtype=torch.float32)
    header = {
        "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "b": {"dtype": "F32", "shape": [2, 3], "data_offsets": [1, 25]},
    }
    file = write(tmp_path, header, b"\x07" + values.numpy().tobytes())
    for path in PATHS:
        tensors = dict(read_safetensors(file, **path))
        assert torch.equal(tensors["b"], values.reshape(2, 3)) and tensors["a"].tolist() == [7]


@pytest.mark.parametrize("path", [{}, CHUNKED[1]])
def test_a_sharded_transformers_checkpoint(make_model, path: dict) -> None:
    model = make_model(num_shards=2)
    files = sorted(model.glob("*.safetensors"))
    assert len(files) == 2
    ref = [item for file in files for item in reference(file)]
    ours = [item for file in files for item in read_safetensors(file, **path)]
    assert_same(ours, ref)
    assert_same(list(iter_safetensors(model)), ref)


@pytest.mark.parametrize("path", PATHS[:2])
def test_only_the_last_tensor_outlives_its_file(tmp_path: Path, path: dict) -> None:
    """A caller holds the last tensor of a file while it asks for the next file's: that one is
    a copy, so the file's buffer goes as soon as the caller moves on."""
    file = tmp_path / "model.safetensors"
    save_file({f"t{i}": torch.full((4, 4), float(i)) for i in range(3)}, str(file))
    tensors = [t for _, t in read_safetensors(file, **path)]
    buffers = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(buffers) == 2 and tensors[-1].untyped_storage().nbytes() == 64


def test_no_files(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="no .safetensors files in"):
        next(iter_safetensors(tmp_path))


def write(tmp_path: Path, header: object, data: bytes, raw: bytes | None = None) -> Path:
    text = raw if raw is not None else json.dumps(header).encode()
    file = tmp_path / "bad.safetensors"
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return file


F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("header", "data", "raw", "message"),
    [
        (None, b"", b"", "not valid JSON"),  # an empty header
        (None, b"", b"{not json", "not valid JSON"),
        (None, b"", b"\xff\xfe\x00{", "not valid JSON"),
        (None, b"", b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        ([1, 2], b"", None, "not a JSON object"),
        ({"a": 3}, b"", None, "entry is not a JSON object"),
        ({"a": {**F32_2, "dtype": "F4"}}, bytes(8), None, "unsupported dtype 'F4'"),
        ({"a": {**F32_2, "dtype": ["F32"]}}, bytes(8), None, "unsupported dtype"),
        ({"a": {**F32_2, "shape": [-2]}}, bytes(8), None, "bad shape"),
        ({"a": {**F32_2, "shape": "2"}}, bytes(8), None, "bad shape"),
        ({"a": {**F32_2, "shape": [2.0]}}, bytes(8), None, "bad shape"),
        (
            {"a": {**F32_2, "shape": [1] * 9999}},
            bytes(8),
            None,
            r"for shape \[1, 1, .*\.\.\. of F32$",
        ),
        ({"a": {**F32_2, "shape": [-1] * 9999}}, bytes(8), None, r"bad shape \[-1, .*\.\.\.$"),
        ({"a": {**F32_2, "data_offsets": [8, 0]}}, bytes(8), None, "bad data_offsets"),
        ({"a": {**F32_2, "data_offsets": [-8, 0]}}, bytes(8), None, "bad data_offsets"),
        ({"a": {**F32_2, "data_offsets": [0, 8, 9]}}, bytes(8), None, "bad data_offsets"),
        ({"a": {"dtype": "F32", "shape": [2]}}, bytes(8), None, "bad data_offsets None"),
        ({"a": F32_2}, bytes(7), None, "run past the end of the file"),
        ({"a": {**F32_2, "data_offsets": [0, 2**70]}}, bytes(8), None, "run past the end"),
        ({"a": {**F32_2, "shape": [3]}}, bytes(8), None, "8 bytes for shape"),
        ({"a": {**F32_2, "shape": [2**40, 2**40]}}, bytes(8), None, "8 bytes for shape"),
    ],
)
def test_a_damaged_header_is_a_job_error(
    tmp_path: Path, header: object, data: bytes, raw: bytes | None, message: str
) -> None:
    file = write(tmp_path, header, data, raw)
    for path in PATHS:
        with pytest.raises(JobError, match=message) as e:
            list(read_safetensors(file, **path))
        assert str(e.value).startswith(f"cannot read {file}: ") and "\n" not in str(e.value)


def test_a_truncated_file_is_a_job_error(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(4, 4), "b": torch.zeros(3)}, str(file))
    whole = file.read_bytes()
    header_end = 8 + struct.unpack("<Q", whole[:8])[0]
    for cut in (0, 5, 8, 9, header_end - 1, header_end, len(whole) - 1):
        file.write_bytes(whole[:cut])
        for path in PATHS:
            with pytest.raises(JobError, match=f"cannot read {file}: "):
                list(read_safetensors(file, **path))
    file.write_bytes(struct.pack("<Q", 2**64 - 1) + b"{}")
    with pytest.raises(JobError, match="header length 18446744073709551615 runs past"):
        list(iter_safetensors(tmp_path))


def test_a_file_that_cannot_be_opened_is_a_job_error(tmp_path: Path) -> None:
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(JobError, match="cannot read .*dir.safetensors"):
        list(iter_safetensors(tmp_path))


@pytest.mark.gpu
@pytest.mark.parametrize(("chunk_bytes", "threads"), [(1 << 20, 3), (4 << 20, 4), (64 << 20, 2)])
def test_the_gpu_path_reads_as_safetensors_does(
    tmp_path: Path, chunk_bytes: int, threads: int
) -> None:
    gen = torch.Generator().manual_seed(1)
    tensors = every_dtype() | {
        f"big.{i}": torch.randn(1000 + i, 997, generator=gen).to(torch.bfloat16) for i in range(6)
    }  # about 12 MB: several chunks, more than the ring holds
    file = tmp_path / "model.safetensors"
    save_file(tensors, str(file))
    device = torch.device("cuda")
    ours = list(read_safetensors(file, device, chunk_bytes=chunk_bytes, threads=threads))
    assert all(t.device.type == "cuda" for _, t in ours)
    assert_same(ours, reference(file))


@pytest.mark.gpu
def test_the_gpu_path_loads_a_sharded_checkpoint(make_model) -> None:
    model = make_model(num_shards=2)
    ref = [item for f in sorted(model.glob("*.safetensors")) for item in reference(f)]
    ours = list(iter_safetensors(model, torch.device("cuda")))
    assert all(t.is_cuda for _, t in ours)
    assert_same(ours, ref)


@pytest.mark.gpu
def test_the_gpu_path_holds_one_file_at_a_time(tmp_path: Path) -> None:
    """Consumed as load_weights does (each tensor copied, then dropped), the device holds one
    file's data (and the copy of a last tensor) at a time."""
    for f in range(3):
        tensors = {f"f{f}.{i}": torch.randn(256, 1024) for i in range(8)}  # 8 MiB a file
        save_file(tensors, str(tmp_path / f"model-{f}.safetensors"))
    device = torch.device("cuda")
    dest = torch.empty(256, 1024, device=device)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    for _, tensor in iter_safetensors(tmp_path, device):
        dest.copy_(tensor)
    assert torch.cuda.max_memory_allocated(device) - base <= (8 << 20) + (1 << 20) + 4096

"""The Triton kernels against the torch layers and TorchAttention.

Without CUDA they run on the CPU in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported) at tiny shapes; with CUDA every test runs on the GPU, and the cases marked `gpu` add
real shapes (head_dim 128, 32/8 heads, bfloat16, page size 16, contexts to 2048).
"""

from __future__ import annotations

import os
import sys

import torch


def _use_interpreter() -> None:
    """Without CUDA, run the kernels in Triton's interpreter. TRITON_INTERPRET must be set before
    triton is imported; in a whole test run torch._dynamo (imported by other test modules) may
    have imported it first, building triton's own library functions (tl.sum, tl.cdiv, ...) for
    the compiler, which the interpreter cannot call. Those are then rebuilt for the interpreter:
    a process without CUDA has no other use for them."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "triton" not in sys.modules:
        return
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    rebuilt: dict[int, InterpretedFunction] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("triton.language") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in rebuilt:
                    rebuilt[id(value)] = InterpretedFunction(value.fn)
                setattr(module, attr, rebuilt[id(value)])


if not torch.cuda.is_available():
    _use_interpreter()

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from batchrun.attention.kv_dtype import FP8  # noqa: E402
from batchrun.attention.meta import AttentionMeta  # noqa: E402
from batchrun.attention.torch_backend import TorchAttention, write_kv_torch  # noqa: E402
from batchrun.attention.triton_backend import TritonAttention  # noqa: E402
from batchrun.kernels import compile_check  # noqa: E402
from batchrun.kernels.triton_attention import (  # noqa: E402
    MIN_SPLIT_KV,
    attention_workspace,
    default_num_splits,
    fp8_words,
    paged_attention,
    write_kv,
)
from batchrun.kernels.triton_fused import (  # noqa: E402
    fused_add_rms_norm_,
    qk_rms_norm_rope_,
    rms_norm,
    rms_norm_rope_,
    silu_and_mul,
)
from batchrun.layers.norm import RMSNorm  # noqa: E402
from batchrun.layers.ops import TORCH_OPS  # noqa: E402
from batchrun.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.helpers.sm90 import compile_offline  # noqa: E402

# The interpreter turns loop bounds loaded from memory into ints the way numpy 2.4 refuses
# (numpy<2.4 is pinned in the test extra); quiet its deprecation notice.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
)
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
gpu = pytest.mark.gpu
# Triton 3.6's interpreter casts float32 to bfloat16 by truncation, not round-to-nearest-even:
# the ops whose bfloat16 results must match torch to the ulp are checked on the GPU only.
# (Attention in bfloat16 still runs here: its tolerance covers one truncated ulp.)
BF16_OPS = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(not CUDA, reason="the interpreter truncates float32 -> bfloat16"),
    id="bfloat16",
)
# Output tolerances (atol = rtol) against a float32 reference on the same inputs.
ATTN_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype).to(DEVICE)


@dataclass
class Batch:
    """R requests' paged caches and metadata; kernel tables pad with a bogus page id that must
    never be read, the reference's pad with 0 (it gathers whole rows)."""

    q_lens: list[int]
    kv_lens: list[int]
    page_size: int
    num_pages: int
    tables: list[list[int]]

    @property
    def cu_q(self) -> list[int]:
        out = [0]
        for n in self.q_lens:
            out.append(out[-1] + n)
        return out

    def table(self, pad: int, window: int | None = None) -> torch.Tensor:
        """With a window: the pages wholly before every row's window hold `pad` too."""
        width = max(1, max(len(t) for t in self.tables))
        rows = []
        for t, q_len, kv_len in zip(self.tables, self.q_lens, self.kv_lens, strict=True):
            first = 0 if window is None else max(kv_len - q_len - window + 1, 0) // self.page_size
            rows.append([pad] * first + t[first:] + [pad] * (width - len(t)))
        return torch.tensor(rows, dtype=torch.int32, device=DEVICE)

    def slots(self) -> list[int]:
        """The cache index of every query row (its own K/V), in row order."""
        out = []
        for q_len, kv_len, table in zip(self.q_lens, self.kv_lens, self.tables, strict=True):
            for p in range(kv_len - q_len, kv_len):
                out.append(table[p // self.page_size] * self.page_size + p % self.page_size)
        return out

    def meta(
        self, causal: bool, kv_index: torch.Tensor, window: int | None = None
    ) -> AttentionMeta:
        positions = [
            p for n, kv in zip(self.q_lens, self.kv_lens, strict=True) for p in range(kv - n, kv)
        ]
        return AttentionMeta(
            positions=torch.tensor(positions, dtype=torch.long, device=DEVICE),
            kv_index=kv_index,
            cu_q=torch.tensor(self.cu_q, dtype=torch.int32, device=DEVICE),
            kv_lens=torch.tensor(self.kv_lens, dtype=torch.int32, device=DEVICE),
            page_table=self.table(0),
            page_size=self.page_size,
            max_q=max(self.q_lens),
            max_kv=max(self.kv_lens),
            causal=causal,
            window=window,
        )


def make_batch(q_lens: list[int], ctx: list[int], page_size: int, seed: int) -> Batch:
    """Request r has ctx[r] cached positions before its q_lens[r] new rows; its pages are drawn
    from a shuffled pool (plus spare pages), so they are neither contiguous nor ordered."""
    kv_lens = [c + n for c, n in zip(ctx, q_lens, strict=True)]
    need = [(kv + page_size - 1) // page_size for kv in kv_lens]
    num_pages = sum(need) + 3
    perm = torch.randperm(num_pages, generator=_gen(seed)).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    return Batch(list(q_lens), kv_lens, page_size, num_pages, tables)


def reference_attention(
    batch: Batch,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    causal: bool,
    window: int | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """TorchAttention in float32 over the same (already written) cache; an FP8 one (with its
    kv_scale) as TorchAttention reads it."""
    backend = TorchAttention()
    no_rows = torch.zeros(0, dtype=torch.long, device=DEVICE)
    backend.plan(batch.meta(causal, no_rows, window))
    if kv_scale is not None:
        return backend.attend(q.float(), k_cache, v_cache, scale, kv_scale)
    return backend.attend(q.float(), k_cache.float(), v_cache.float(), scale)


def run_attention_case(
    q_lens: list[int],
    ctx: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    causal: bool,
    num_splits: int = 1,
    block_n: int | None = None,
    extra_rows: int = 0,
    seed: int = 0,
    min_split_kv: int = MIN_SPLIT_KV,
    window: int | None = None,
    kv_fp8: bool = False,
) -> None:
    """The kernel against TorchAttention; its table pads with a page id that must never be
    read, also for the pages wholly before a window. kv_fp8: caches in float8_e4m3fn (values
    over many of its binades) with scales of their own, against TorchAttention's FP8 reading."""
    batch = make_batch(q_lens, ctx, page_size, seed)
    shape = (batch.num_pages, page_size, num_kv_heads, head_dim)
    cache_dtype, spread, kv_scale = dtype, 1.0, None
    if kv_fp8:
        cache_dtype, spread = FP8, 4.0
        kv_scale = torch.tensor([0.25, 1.5], device=DEVICE)  # K's, V's
    k_cache = _randn(*shape, dtype=cache_dtype, seed=seed + 1, scale=spread)
    v_cache = _randn(*shape, dtype=cache_dtype, seed=seed + 2, scale=spread)
    num_rows = sum(q_lens)
    q = _randn(num_rows + extra_rows, num_heads, head_dim, dtype=dtype, seed=seed + 3)
    scale = head_dim**-0.5
    sentinel = 7.0
    out = torch.full_like(q, sentinel)
    workspace = None
    if num_splits > 1:
        workspace = attention_workspace(
            num_splits, q.shape[0], num_heads, head_dim, torch.device(DEVICE)
        )
        workspace.out.fill_(float("nan"))  # unwritten partials must never be read
        workspace.lse.fill_(float("nan"))
        workspace.active.fill_(-1)  # nor unwritten split counts (the combine would skip a row)
    cu_q = torch.tensor(batch.cu_q, dtype=torch.int32, device=DEVICE)
    kv_lens = torch.tensor(batch.kv_lens, dtype=torch.int32, device=DEVICE)
    paged_attention(
        q,
        k_cache,
        v_cache,
        cu_q,
        kv_lens,
        batch.table(pad=10**8, window=window),
        scale=scale,
        causal=causal,
        max_q=max(q_lens),
        out=out,
        window=window,
        num_splits=num_splits,
        workspace=workspace,
        block_n=block_n,
        min_split_kv=min_split_kv,
        kv_scale=kv_scale,
    )
    want = reference_attention(
        batch, q[:num_rows], k_cache, v_cache, scale, causal, window, kv_scale
    )
    tol = ATTN_TOL[dtype]
    torch.testing.assert_close(out[:num_rows].float(), want, atol=tol, rtol=tol)
    assert bool((out[num_rows:] == sentinel).all()), "rows owned by no request were written"


# Mixed q lengths in one batch, with a padding request (q_len 0) and cached prefixes that span
# several pages.
MIXED_Q = [0, 1, 3, 16, 40]
MIXED_CTX = [5, 37, 0, 20, 9]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_attention_mixed_lengths(group: int, causal: bool) -> None:
    run_attention_case(MIXED_Q, MIXED_CTX, 2 * group, 2, 16, 16, torch.float32, causal)


@pytest.mark.parametrize(("page_size", "block_n"), [(16, 16), (16, 32), (32, 16), (8, 64)])
def test_attention_tiles_and_pages(page_size: int, block_n: int) -> None:
    run_attention_case(
        [3, 0, 9], [30, 4, 50], 4, 2, 32, page_size, torch.float32, True, block_n=block_n
    )


@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_decode(num_splits: int) -> None:
    """Decode rows (q_len 1) and padding requests (q_len 0, kv_len 0), with spare rows past
    cu_q[R] that no request owns."""
    run_attention_case(
        [1, 0, 1, 1, 0],
        [70, 0, 1, 33, 0],
        8,
        2,
        32,
        16,
        torch.float32,
        True,
        num_splits=num_splits,
        block_n=16,
        extra_rows=2,
    )


@pytest.mark.parametrize("causal", [True, False], ids=["verify", "draft_block"])
def test_attention_blocks_of_rows(causal: bool) -> None:
    """Verify (causal, B rows per request) and the DFlash draft block (non-causal over context
    plus block), split or not; with 16 positions a split, the requests use 2, 1 and 3 splits."""
    for num_splits, min_split_kv in ((1, MIN_SPLIT_KV), (2, MIN_SPLIT_KV), (4, 16)):
        run_attention_case(
            [4, 4, 0, 4],
            [21, 3, 0, 40],
            4,
            1,
            16,
            16,
            torch.float32,
            causal,
            num_splits,
            min_split_kv=min_split_kv,
        )


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "draft_block"])
@pytest.mark.parametrize(("window", "num_splits"), [(8, 1), (8, 2), (21, 4), (1000, 1)])
def test_attention_sliding_window(causal: bool, window: int, num_splits: int) -> None:
    """A sliding draft layer's blocks of 4 rows (a row at q sees positions > q - window) and
    mixed rows: the pages before every row's window are never read, splits cover only the
    window, a window longer than the context changes nothing."""
    for q_lens, ctx in (([4, 4, 0, 4], [40, 3, 0, 90]), (MIXED_Q, MIXED_CTX)):
        run_attention_case(
            q_lens,
            ctx,
            4,
            2,
            16,
            4,
            torch.float32,
            causal,
            num_splits=num_splits,
            block_n=16,
            extra_rows=2,
            min_split_kv=16,
            window=window,
        )


def test_attention_splits_mixed() -> None:
    run_attention_case(MIXED_Q, MIXED_CTX, 4, 2, 16, 16, torch.float32, True, num_splits=4)
    run_attention_case(
        MIXED_Q, MIXED_CTX, 4, 2, 16, 16, torch.float32, True, num_splits=4, min_split_kv=16
    )


@pytest.mark.parametrize("num_splits", [3, 6, 16])
def test_attention_decode_active_splits(num_splits: int) -> None:
    """A static split count above what most contexts fill (a graph captured for long contexts):
    with 16 positions a split and 16-position tiles, kv_len 1, 5 and 16 use one split (written
    directly, skipped by the combine), 17 uses 2, 40 uses 3 and 208 uses 13, or 5 when capped at
    6 (13 tiles in splits of 3); next to padding requests (q_len 0, kv_len 0) and spare rows."""
    run_attention_case(
        [1, 1, 0, 1, 1, 1, 0, 1],
        [0, 4, 0, 15, 16, 39, 0, 207],
        8,
        2,
        32,
        16,
        torch.float32,
        True,
        num_splits=num_splits,
        block_n=16,
        extra_rows=3,
        min_split_kv=16,
    )


@pytest.mark.parametrize("causal", [True, False], ids=["prefill", "noncausal"])
def test_attention_active_splits_per_query_block(causal: bool) -> None:
    """Several query blocks per request (40 rows x 8 heads: blocks of 32 rows): causal blocks see
    different kv ranges and so use different split counts for the rows of one request."""
    run_attention_case(
        [40, 1, 0, 33],
        [0, 50, 0, 10],
        8,
        1,
        16,
        16,
        torch.float32,
        causal,
        num_splits=4,
        block_n=16,
        extra_rows=2,
        min_split_kv=16,
    )


def test_attention_splits_bfloat16() -> None:
    """Partials in float32, the output (direct or combined) in bfloat16; 6 query heads in the
    combine's blocks of 4 leave the last block partly masked."""
    run_attention_case(
        [1, 1, 2, 0],
        [3, 90, 60, 0],
        6,
        2,
        16,
        16,
        torch.bfloat16,
        True,
        num_splits=3,
        block_n=16,
        extra_rows=1,
        min_split_kv=16,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_half(dtype: torch.dtype) -> None:
    run_attention_case(MIXED_Q, MIXED_CTX, 4, 2, 16, 16, dtype, True)


def test_write_kv_then_attend_matches_torch_backend() -> None:
    """write_kv + paged_attention do what TorchAttention.forward does (write, then attend)."""
    batch = make_batch([2, 0, 5, 1], [14, 3, 17, 0], 16, seed=5)
    hq, hkv, dim = 4, 2, 16
    shape = (batch.num_pages, 16, hkv, dim)
    k_cache = _randn(*shape, dtype=torch.float32, seed=6)
    v_cache = _randn(*shape, dtype=torch.float32, seed=7)
    rows = sum(batch.q_lens)
    q = _randn(rows, hq, dim, dtype=torch.float32, seed=8)
    k = _randn(rows, hkv, dim, dtype=torch.float32, seed=9)
    v = _randn(rows, hkv, dim, dtype=torch.float32, seed=10)
    slots = torch.tensor(batch.slots(), dtype=torch.long, device=DEVICE)
    backend = TorchAttention()
    backend.plan(batch.meta(True, slots))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    backend.write_kv(k, v, ref_k, ref_v)
    want = backend.attend(q, ref_k, ref_v, dim**-0.5)

    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    got = paged_attention(
        q,
        k_cache,
        v_cache,
        torch.tensor(batch.cu_q, dtype=torch.int32, device=DEVICE),
        torch.tensor(batch.kv_lens, dtype=torch.int32, device=DEVICE),
        batch.table(pad=0),
        scale=dim**-0.5,
        causal=True,
        max_q=max(batch.q_lens),
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def run_write_kv_case(
    num_rows: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype
) -> None:
    num_pages = (2 * num_rows) // page_size + 2
    slots = torch.randperm(num_pages * page_size, generator=_gen(1))[:num_rows]
    slots[::3] = -1  # padding rows
    slots = slots.to(DEVICE)
    k = _randn(num_rows, num_kv_heads, head_dim, dtype=dtype, seed=2)
    v = _randn(num_rows, num_kv_heads, head_dim, dtype=dtype, seed=3)
    k_cache = _randn(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, seed=4)
    v_cache = _randn(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, seed=5)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    ref_k.view(-1, num_kv_heads, head_dim)[slots[keep]] = k[keep]
    ref_v.view(-1, num_kv_heads, head_dim)[slots[keep]] = v[keep]
    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads", [1, 3])
def test_write_kv(num_kv_heads: int, dtype: torch.dtype) -> None:
    run_write_kv_case(11, num_kv_heads, 16, 16, dtype)


def test_write_kv_strided_rows() -> None:
    """k and v as views of one fused projection [T, (Hq + 2 Hkv) * D]."""
    hq, hkv, dim = 4, 2, 16
    qkv = _randn(6, (hq + 2 * hkv) * dim, dtype=torch.float32, seed=1)
    k = qkv[:, hq * dim : (hq + hkv) * dim].view(6, hkv, dim)
    v = qkv[:, (hq + hkv) * dim :].view(6, hkv, dim)
    k_cache = torch.zeros(2, 8, hkv, dim, device=DEVICE)
    v_cache = torch.zeros(2, 8, hkv, dim, device=DEVICE)
    slots = torch.tensor([9, -1, 0, 15, 3, -1], device=DEVICE)
    write_kv(k, v, k_cache, v_cache, slots)
    keep = slots >= 0
    assert torch.equal(k_cache.view(-1, hkv, dim)[slots[keep]], k[keep])
    assert torch.equal(v_cache.view(-1, hkv, dim)[slots[keep]], v[keep])
    assert int((k_cache.view(-1, hkv, dim).abs().sum((1, 2)) > 0).sum()) == 4


def test_default_num_splits() -> None:
    assert MIN_SPLIT_KV == 64  # the values below assume it
    assert default_num_splits(1, 8, 40960) == 16  # a graph's maximum, whatever the contexts
    assert default_num_splits(1, 8, 4096) == 16
    assert default_num_splits(1, 8, 512) == 8
    assert default_num_splits(1, 8, 65) == 2
    assert default_num_splits(8, 8, 4096) == 5
    assert default_num_splits(256, 8, 4096) == 1
    assert default_num_splits(4, 8, 60) == 1


# ---------------------------------------------------------------------------------------------
# FP8 K/V (float8_e4m3fn caches with per-tensor scales)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_fp8_kv_attention_mixed_lengths(causal: bool) -> None:
    run_attention_case(MIXED_Q, MIXED_CTX, 4, 2, 16, 16, torch.float32, causal, kv_fp8=True)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_kv_attention_decode(num_splits: int) -> None:
    """Split partials carry V's scale into the combine; decode's tiles read the cache in words
    (FP8_WORDS: K^T, and V as pairs of columns)."""
    assert fp8_words(True, 32, 16)
    run_attention_case(
        [1, 0, 1, 1, 0],
        [70, 0, 1, 33, 0],
        8,
        2,
        32,
        16,
        torch.float32,
        True,
        num_splits=num_splits,
        block_n=16,
        extra_rows=2,
        min_split_kv=16,
        kv_fp8=True,
    )


def test_fp8_kv_attention_window_and_half() -> None:
    """A sliding window's blocks; bfloat16 queries over an FP8 cache."""
    run_attention_case(
        [4, 4, 0, 4],
        [40, 3, 0, 90],
        4,
        2,
        16,
        4,
        torch.float32,
        True,
        num_splits=2,
        block_n=16,
        min_split_kv=16,
        window=8,
        kv_fp8=True,
    )
    run_attention_case(MIXED_Q, MIXED_CTX, 4, 2, 16, 16, torch.bfloat16, True, kv_fp8=True)


def fp8_edge_values() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties: to even) and the float32
    values beside them, both signs, zeros, values past 448 (saturated) and below e4m3's
    subnormals, and log-uniform ones over its whole range."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = torch.tensor(1e9), torch.tensor(-1e9)
    spread = torch.exp(torch.empty(4096).uniform_(-16, 7, generator=_gen(3)))
    edges = torch.tensor([0.0, -0.0, 448.0, 449.0, 464.0, 500.0, 1e6, 1e-4, 2.0**-10, 1e-30])
    values = torch.cat(
        [grid, mids, torch.nextafter(mids, up), torch.nextafter(mids, down), spread, edges]
    )
    return torch.cat([values, -values])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kv_write_rounds_as_torch_does(dtype: torch.dtype) -> None:
    """write_kv into FP8 caches stores, byte for byte, what the torch backend stores: x / scale
    saturated to +-448, rounded to nearest even (-0.0 kept); padding rows write nothing."""
    values = fp8_edge_values().to(dtype).float()
    dim = 16
    values = torch.cat([values, values.new_zeros(-values.numel() % (2 * dim))])
    k = values.view(-1, 2, dim).to(dtype).to(DEVICE)
    v = k.flip(0).contiguous()
    rows = k.shape[0]
    slots = torch.randperm(rows + 8, generator=_gen(4))[:rows].to(DEVICE)
    slots[::7] = -1
    for scales in ([1.0, 1.0], [0.37, 3.0]):
        kv_scale = torch.tensor(scales, device=DEVICE)
        caches = [torch.full((rows + 8, 1, 2, dim), 0.5, device=DEVICE).to(FP8) for _ in range(4)]
        write_kv(k, v, caches[0], caches[1], slots, kv_scale)
        write_kv_torch(k, v, caches[2], caches[3], slots, kv_scale)
        for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        expected = (k.float() / kv_scale[0]).clamp(-448, 448).to(FP8)  # rounded here by hand
        keep = slots >= 0
        stored = caches[0].view(torch.uint8).view(-1, 2, dim)[slots[keep]]  # bytes: any device
        assert torch.equal(stored, expected.view(torch.uint8)[keep])


def test_fp8_kv_backends_write_then_attend_alike() -> None:
    """TritonAttention and TorchAttention, each writing this forward's rows into its own FP8
    caches and attending over them (prefill chunks, decode rows, a padding request)."""
    batch = make_batch([2, 0, 5, 1], [14, 3, 17, 0], 16, seed=5)
    hq, hkv, dim = 4, 2, 16
    shape = (batch.num_pages, 16, hkv, dim)
    k_cache = _randn(*shape, dtype=FP8, seed=6, scale=3.0)
    v_cache = _randn(*shape, dtype=FP8, seed=7, scale=3.0)
    rows = sum(batch.q_lens)
    q = _randn(rows, hq, dim, dtype=torch.float32, seed=8)
    k = _randn(rows, hkv, dim, dtype=torch.float32, seed=9, scale=3.0)
    v = _randn(rows, hkv, dim, dtype=torch.float32, seed=10, scale=3.0)
    kv_scale = torch.tensor([0.5, 2.0], device=DEVICE)
    meta = batch.meta(True, torch.tensor(batch.slots(), dtype=torch.long, device=DEVICE))
    outs, caches = [], []
    for backend in (TorchAttention(), TritonAttention(rows, hq, hkv, dim)):
        kc, vc = k_cache.clone(), v_cache.clone()
        backend.plan(meta)
        backend.write_kv(k, v, kc, vc, kv_scale=kv_scale)
        outs.append(backend.attend(q, kc, vc, dim**-0.5, kv_scale))
        caches.append(torch.cat([kc.view(torch.uint8), vc.view(torch.uint8)]))
    assert torch.equal(caches[0], caches[1])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


@gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_gpu_fp8_kv_attention(num_splits: int) -> None:
    """Real shapes, bfloat16 queries over FP8 caches: the Triton kernel against the torch
    backend's FP8 reading, on CUDA (prefill chunks and decode rows, long contexts)."""
    run_attention_case(
        [0, 1, 3, 16, 40, 300, 17, 1],
        [0, 2047, 600, 1500, 9, 700, 2000, 1200],
        32,
        8,
        128,
        16,
        torch.bfloat16,
        True,
        num_splits=num_splits,
        kv_fp8=True,
    )
    ctx = torch.randint(1, 2048, (256,), generator=_gen(11)).tolist()
    run_attention_case(
        [1] * 256,
        ctx,
        32,
        8,
        128,
        16,
        torch.bfloat16,
        True,
        num_splits=num_splits,
        extra_rows=3,
        kv_fp8=True,
    )


# ---------------------------------------------------------------------------------------------
# RMSNorm, residual add + RMSNorm, q/k norm + RoPE, SiLU-and-mul

# Half precision: the kernel's float32 sum of squares is ordered differently from torch's, which
# can move a value across a rounding boundary: an ulp of the dtype (two, rarely, once the weight
# multiplies it), and only for a few elements.
OPS_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def assert_matches_torch(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within OPS_TOL, and in half precision bit-identical for all but a few elements (which
    shows the roundings happen where torch's happen)."""
    tol = OPS_TOL[want.dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if want.dtype != torch.float32:
        differ = (got != want).float().mean().item()
        assert differ <= 0.02, f"{differ:.1%} of elements differ from torch"


def _norm(dim: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.5 * torch.randn(dim, generator=_gen(seed)))
    return norm.to(DEVICE, dtype)


def run_rms_norm_case(rows: int, dim: int, dtype: torch.dtype) -> None:
    norm = _norm(dim, dtype, 0)
    x = _randn(rows, dim, dtype=dtype, seed=1, scale=3.0)
    with torch.no_grad():
        want = norm(x)
    got = rms_norm(x, norm.weight, norm.eps)
    assert_matches_torch(got, want)

    residual = _randn(rows, dim, dtype=dtype, seed=2, scale=3.0)
    with torch.no_grad():
        want_res = residual + x
        want_out = norm(want_res)
    x2, res2 = x.clone(), residual.clone()
    out = fused_add_rms_norm_(x2, res2, norm.weight, norm.eps)
    assert out.data_ptr() == x2.data_ptr()
    assert torch.equal(res2, want_res)
    assert_matches_torch(x2, want_out)


@pytest.mark.parametrize("dtype", [torch.float32, BF16_OPS, torch.float16])
@pytest.mark.parametrize("dim", [64, 48])
def test_rms_norm(dim: int, dtype: torch.dtype) -> None:
    run_rms_norm_case(5, dim, dtype)


def run_qk_norm_rope_case(
    rows: int, hq: int, hkv: int, dim: int, dtype: torch.dtype, max_pos: int = 64
) -> None:
    """q/k as views of one fused projection, as PagedAttention computes them."""
    q_norm, k_norm = _norm(dim, dtype, 1), _norm(dim, dtype, 2)
    rope = RotaryEmbedding(dim, max_pos, 1_000_000.0).to(DEVICE)
    qkv = _randn(rows, (hq + 2 * hkv) * dim, dtype=dtype, seed=3, scale=2.0)
    q = qkv[:, : hq * dim].view(rows, hq, dim)
    k = qkv[:, hq * dim : (hq + hkv) * dim].view(rows, hkv, dim)
    positions = torch.randint(0, max_pos, (rows,), generator=_gen(4)).to(DEVICE)
    with torch.no_grad():
        want_q = TORCH_OPS.norm_rope(q, q_norm.weight, 1e-6, rope.cos, rope.sin, positions)
        want_k = TORCH_OPS.norm_rope(k, k_norm.weight, 1e-6, rope.cos, rope.sin, positions)
    v_before = qkv[:, (hq + hkv) * dim :].clone()
    qk_rms_norm_rope_(q, k, q_norm.weight, k_norm.weight, rope.cos, rope.sin, positions, 1e-6)
    assert_matches_torch(q, want_q)
    assert_matches_torch(k, want_k)
    assert torch.equal(qkv[:, (hq + hkv) * dim :], v_before)

    k2 = qkv.new_empty(rows, hkv, dim).copy_(_randn(rows, hkv, dim, dtype=dtype, seed=5))
    with torch.no_grad():
        want_k2 = TORCH_OPS.norm_rope(k2, k_norm.weight, 1e-6, rope.cos, rope.sin, positions)
    rms_norm_rope_(k2, k_norm.weight, rope.cos, rope.sin, positions, 1e-6)
    assert_matches_torch(k2, want_k2)


@pytest.mark.parametrize("dtype", [torch.float32, BF16_OPS, torch.float16])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (6, 3)])
def test_qk_norm_rope(hq: int, hkv: int, dtype: torch.dtype) -> None:
    run_qk_norm_rope_case(5, hq, hkv, 16, dtype)


def run_silu_case(rows: int, inter: int, dtype: torch.dtype) -> None:
    gate_up = _randn(rows, 2 * inter, dtype=dtype, seed=1, scale=3.0)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up  # the torch path, in the input dtype
    got = silu_and_mul(gate_up)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:
        # The same two roundings as torch; exp may differ by an ulp of float32 from torch's.
        same = (got == want).float().mean().item()
        assert same >= 0.98, same
    out = torch.full((rows, inter), 3.0, dtype=dtype, device=DEVICE)
    assert silu_and_mul(gate_up, out=out) is out and torch.equal(out, got)


@pytest.mark.parametrize("dtype", [torch.float32, BF16_OPS, torch.float16])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    run_silu_case(4, 40, dtype)


def test_empty_inputs() -> None:
    """Zero rows launch nothing and touch nothing."""
    q = torch.zeros(0, 4, 16, device=DEVICE)
    cache = torch.zeros(2, 16, 2, 16, device=DEVICE)
    cu_q = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    no_req = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    table = torch.zeros(0, 1, dtype=torch.int32, device=DEVICE)
    out = paged_attention(
        q, cache, cache, cu_q, no_req, table, scale=0.25, causal=True, max_q=1, out=q
    )
    assert out.shape == (0, 4, 16)
    write_kv(
        cache[0, :0], cache[0, :0], cache, cache, torch.zeros(0, dtype=torch.long, device=DEVICE)
    )
    x = torch.zeros(0, 8, device=DEVICE)
    assert rms_norm(x, torch.ones(8, device=DEVICE), 1e-6).numel() == 0
    assert silu_and_mul(x).shape == (0, 4)


@pytest.mark.skipif(not compile_check.available(), reason="Triton's NVIDIA tools are missing")
def test_attention_compiles_for_sm90_without_spills() -> None:
    """Qwen3-8B's decode and verify attention compile for Hopper ahead of time
    (no GPU needed) with no register spills; `python -m batchrun.kernels.compile_check` checks
    every configuration."""
    run = compile_offline("-m", "batchrun.kernels.compile_check", "--quick")
    assert run.returncode == 0, run.stdout + run.stderr


# ---------------------------------------------------------------------------------------------
# Real shapes (Qwen3-8B: 32 query heads, 8 kv heads, head_dim 128), on the GPU only.


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_gpu_attention_mixed(causal: bool, dtype: torch.dtype) -> None:
    run_attention_case(
        [0, 1, 3, 16, 40, 300, 17],
        [0, 2047, 600, 1500, 9, 700, 2000],
        32,
        8,
        128,
        16,
        dtype,
        causal,
    )


@gpu
@pytest.mark.parametrize("num_splits", [1, 4, 16])
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_gpu_attention_decode(batch: int, num_splits: int) -> None:
    ctx = torch.randint(1, 2048, (batch,), generator=_gen(batch)).tolist()
    q_lens = [1] * batch
    q_lens[batch // 2] = 0  # a padding request
    run_attention_case(
        q_lens, ctx, 32, 8, 128, 16, torch.bfloat16, True, num_splits=num_splits, extra_rows=3
    )


@gpu
@pytest.mark.parametrize("causal", [True, False], ids=["verify", "draft_block"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_gpu_attention_blocks(causal: bool, num_splits: int) -> None:
    ctx = torch.randint(0, 2032, (32,), generator=_gen(7)).tolist()
    q_lens = [16] * 32
    q_lens[3] = 0
    run_attention_case(q_lens, ctx, 32, 8, 128, 16, torch.bfloat16, causal, num_splits)


@gpu
@pytest.mark.parametrize("group", [1, 2, 4])
def test_gpu_attention_group_ratios(group: int) -> None:
    run_attention_case(MIXED_Q, [2000, 37, 1000, 20, 9], 8 * group, 8, 64, 16, torch.float16, True)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_write_kv(dtype: torch.dtype) -> None:
    run_write_kv_case(4096, 8, 128, 16, dtype)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_ops(dtype: torch.dtype) -> None:
    run_rms_norm_case(512, 4096, dtype)
    run_qk_norm_rope_case(512, 32, 8, 128, dtype, max_pos=4096)
    run_silu_case(512, 12288, dtype)

"""Paged attention in Triton: one kernel family for prefill/extend, decode, verify and the DFlash
draft block, plus the K/V page write.

Semantics are those of `TorchAttention` (attention/torch_backend.py) without the K/V write, which
is `write_kv` here:

- q [T, Hq, D] holds the packed rows of R requests: request r owns rows cu_q[r]:cu_q[r+1]
  (cu_q[0] == 0; rows from cu_q[R] to T belong to no request and are never written).
- k/v caches [num_pages, page_size, Hkv, D]; kv_lens [R] int32 is each request's cached length
  after this step's writes; page_table [R, max_pages] int32 maps position p of request r to index
  page_table[r, p // page_size] * page_size + p % page_size.
- causal: query row i of request r sits at position kv_lens[r] - q_len[r] + i and sees the cached
  positions <= it (the engine's `positions` always satisfy this). Non-causal (the DFlash draft
  block): every row sees all kv_lens[r] positions.
- window (a sliding-window draft layer): a row at position q sees only positions > q - window;
  tiles wholly before the window of a program's first row are skipped, never read.

One program serves one (request, block of BLOCK_Q query tokens, kv head, kv split): it loads each
K/V tile once for all GROUP = Hq // Hkv query heads of its kv head (the tile's rows are query tokens
x heads of the group) and keeps an online softmax in float32. The grid depends only on host ints
(R, max_q, Hkv, num_splits), never on device data, so a launch can be captured in a CUDA graph;
programs past a request's rows exit at once, and requests with q_len 0 write nothing.

Split-KV (num_splits > 1) cuts the kv range of each (request, query block) into up to num_splits
parts that run as separate programs, then `_combine_kernel` merges them; it needs a caller-owned
workspace (see `attention_workspace`) and pays where R * Hkv programs leave most of the GPU idle
(small-batch decode over long contexts). num_splits only sizes the grid, so a graph captured for
its longest context still serves short ones cheaply: a block uses one split per MIN_SPLIT_KV
positions it sees (at least one, decided on the device), the surplus programs exit at once, and a
block left with one split writes its output directly, rows the combine then skips.

FP8 caches (float8_e4m3fn, per-tensor scales: batchrun/attention/kv_dtype.py) are a constexpr
case of the same kernels, so a cache in the model dtype compiles to the code it always did. The
attention kernel widens each fp8 tile to float16 (exact, and one instruction a pair on Hopper,
where bfloat16 takes a detour; decode's tiles are read in words, see fp8_words) and runs its dots
in float16 (q too), and folds the scales out of the tiles: K's into the logits' scale, V's into
the output, as softmax(q . (s_k k)) (s_v v) = s_v softmax((s_k q) . k) v. The write divides by
the scale, saturates to +-448 and rounds to nearest even, as torch's cast does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchrun.kernels.e4m3 import e4m3_rounded

__all__ = [
    "MIN_SPLIT_KV",
    "AttentionWorkspace",
    "attention_workspace",
    "default_num_splits",
    "fp8_words",
    "interpreting",
    "paged_attention",
    "write_kv",
]

_LOG2E = 1.4426950408889634
# Fewest kv positions worth a split of their own: shorter splits cost more in partials and in the
# combine than their parallelism saves, longer ones leave programs idle at batch 1 (measured:
# docs/benchmarks.md, Kernel tuning).
MIN_SPLIT_KV = 64


def interpreting(t: torch.Tensor) -> bool:
    """True when Triton runs these kernels in its CPU interpreter (TRITON_INTERPRET=1, or the
    tensors are on the CPU, which only the interpreter can run)."""
    return t.device.type == "cpu" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 dots default to TF32 on the GPU; "ieee" keeps float32 results close to torch.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    active_ptr,
    cu_q_ptr,
    kv_lens_ptr,
    page_table_ptr,
    kv_scale_ptr,
    scale_log2,
    q_blocks,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_wos,
    stride_wot,
    stride_woh,
    stride_wls,
    stride_wlt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MIN_SPLIT_KV: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_WORDS: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = pid // q_blocks
    # A request's last query blocks first: causal ones see the most K/V, and started first they
    # leave no long program at the tail of the launch.
    q_lo = (q_blocks - 1 - pid % q_blocks) * BLOCK_Q
    row_begin = tl.load(cu_q_ptr + req)
    q_len = tl.load(cu_q_ptr + req + 1) - row_begin
    if q_lo >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + req)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = q_lo + offs_m // GROUP  # query token of each tile row, within the request
    head = kv_head * GROUP + offs_m % GROUP  # its query head
    row_ok = (offs_m // GROUP < BLOCK_Q) & (tok < q_len)
    rows = (row_begin + tok).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr)  # K's scale, out of every tile
        if not DOT_F32:
            q = q.to(tl.float16)  # fp8 widens to float16 in one instruction (not to bfloat16)
    q_pos = kv_len - q_len + tok
    # Causal: the block's last row sees up to its own position; otherwise every row sees all.
    kv_end = kv_len - q_len + tl.minimum(q_lo + BLOCK_Q, q_len) if CAUSAL else kv_len
    # A window: nothing before the block's first row's window is read.
    kv_begin = tl.maximum(kv_len - q_len + q_lo - window + 1, 0) if WINDOWED else 0
    n_tiles = tl.cdiv(kv_end - kv_begin, BLOCK_N)
    if NUM_SPLITS == 1:
        tiles_per_split = n_tiles
    else:
        # This block's own split count: one per MIN_SPLIT_KV positions, at most NUM_SPLITS,
        # then only as many as its tiles fill (no active split is empty).
        want = tl.minimum(tl.maximum(tl.cdiv(kv_end - kv_begin, MIN_SPLIT_KV), 1), NUM_SPLITS)
        tiles_per_split = tl.maximum(tl.cdiv(n_tiles, want), 1)
        active = tl.maximum(tl.cdiv(n_tiles, tiles_per_split), 1)
        if split >= active:
            return
    kv_lo = kv_begin + split * tiles_per_split * BLOCK_N
    kv_hi = tl.minimum(kv_lo + tiles_per_split * BLOCK_N, kv_end)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if FP8_WORDS:  # V read as 16-bit pairs of columns: acc the even ones, acc_odd the odd
        acc = tl.zeros([BLOCK_M, HEAD_DIM // 2], dtype=tl.float32)
        acc_odd = tl.zeros([BLOCK_M, HEAD_DIM // 2], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table = page_table_ptr + req.to(tl.int64) * stride_pt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + offs_n
        in_range = pos < kv_hi
        page = tl.load(table + pos // PAGE_SIZE, mask=in_range, other=0).to(tl.int64)
        slot_in_page = pos % PAGE_SIZE
        # FP8_WORDS: the dots of tiles under 64 rows take their operands in registers, and
        # Triton reads an fp8 tile whose dot operand runs across its rows (K transposed, V)
        # from shared memory a byte at a time. K^T is loaded as such; V as 16-bit pairs
        # (v[2j], v[2j + 1]), read as bf16's is, each byte's sign and exponent-mantissa bits
        # then moved into float16's places: its value / 2^8 (normal and subnormal alike), two
        # float16 tiles rescaled after the loop. Larger tiles (wgmma, operands in shared
        # memory) have no byte reads and are slower this way.
        k_at = k_cache_ptr + page * stride_kp + slot_in_page * stride_ks + kv_head * stride_kh
        if FP8_WORDS:
            k_t = tl.load(k_at[None, :] + offs_d[:, None], mask=in_range[None, :], other=0.0)
        else:
            k = tl.load(k_at[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0)
            k_t = tl.trans(k)
        v_at = page * stride_vp + slot_in_page * stride_vs + kv_head * stride_vh
        if FP8_WORDS:
            pairs = tl.load(
                v_cache_ptr.to(tl.pointer_type(tl.uint16))
                + (v_at // 2)[:, None]
                + tl.arange(0, HEAD_DIM // 2)[None, :],
                mask=in_range[:, None],
                other=0,
            ).to(tl.int32)
            v = (((pairs & 0x80) << 8) | ((pairs & 0x7F) << 7)).to(tl.uint16)
            v_odd = ((pairs & 0x8000) | ((pairs & 0x7F00) >> 1)).to(tl.uint16)
            v = v.to(tl.float16, bitcast=True)
            v_odd = v_odd.to(tl.float16, bitcast=True)
        else:
            v = tl.load(
                v_cache_ptr + v_at[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0
            )
        if DOT_F32:
            k_t = k_t.to(tl.float32)
            v = v.to(tl.float32)
            if FP8_WORDS:
                v_odd = v_odd.to(tl.float32)
        elif KV_FP8:
            k_t = k_t.to(tl.float16)
            v = v.to(tl.float16)
        qk = tl.dot(q, k_t, input_precision=PRECISION) * scale_log2
        visible = in_range[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        if WINDOWED:
            visible = visible & (pos[None, :] > (q_pos - window)[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        if FP8_WORDS:
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd, input_precision=PRECISION)
        m_i = m_new

    if FP8_WORDS:  # the columns back in order, and the pairs' 2^8
        acc = tl.reshape(tl.join(acc, acc_odd), (BLOCK_M, HEAD_DIM)) * 256.0
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if KV_FP8:
        o = o * tl.load(kv_scale_ptr + 1)  # V's scale (partials too: the combine is linear)
    out_ptrs = out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # The combine reads each row's split count (one writer per row: kv head 0, split 0).
        if (kv_head == 0) & (split == 0):
            tl.store(active_ptr + rows, active, mask=row_ok & (offs_m % GROUP == 0))
        if active == 1:
            tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            # Partial result of this split: normalised output and its log2-sum-exp (-inf if
            # it saw no position).
            lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
            tl.store(
                part_out_ptr
                + split.to(tl.int64) * stride_wos
                + rows[:, None] * stride_wot
                + head[:, None] * stride_woh
                + offs_d[None, :],
                o,
                mask=row_ok[:, None],
            )
            lse_ptr = part_lse_ptr + split.to(tl.int64) * stride_wls
            tl.store(lse_ptr + rows * stride_wlt + head, lse, mask=row_ok)


@triton.jit
def _combine_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    active_ptr,
    cu_q_ptr,
    num_requests,
    stride_ot,
    stride_oh,
    stride_wos,
    stride_wot,
    stride_woh,
    stride_wls,
    stride_wlt,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One program per (query row, block of BLOCK_H heads): loads the row's active partials at
    once (BLOCK_S >= num_splits) and merges them; rows with one active split are already done."""
    row = tl.program_id(0)
    if row < tl.load(cu_q_ptr) or row >= tl.load(cu_q_ptr + num_requests):
        return
    num_active = tl.load(active_ptr + row)
    if num_active <= 1:
        return
    row64 = row.to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    h_ok = offs_h < NUM_HEADS
    used = h_ok[:, None] & (offs_s < num_active)[None, :]  # [BLOCK_H, BLOCK_S]
    # Split offsets in 64 bits, whatever the workspace size.
    split64 = offs_s.to(tl.int64)
    lse = tl.load(
        part_lse_ptr + split64[None, :] * stride_wls + row64 * stride_wlt + offs_h[:, None],
        mask=used,
        other=float("-inf"),
    )
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m[:, None])  # 0 for unused or empty splits
    o = tl.load(
        part_out_ptr
        + split64[None, :, None] * stride_wos
        + row64 * stride_wot
        + offs_h[:, None, None] * stride_woh
        + offs_d[None, None, :],
        mask=(used & (w > 0.0))[:, :, None],
        other=0.0,
    )
    acc = tl.sum(w[:, :, None] * o, 1)
    total = tl.sum(w, 1)
    total = tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + row64 * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
        (acc / total[:, None]).to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None],
    )


@dataclass(frozen=True)
class AttentionWorkspace:
    """Split-KV partials, owned by the caller and reused across launches (and graph replays):
    out [num_splits, max_tokens, Hq, D] float32, lse [num_splits, max_tokens, Hq] float32, and
    active [max_tokens] int32, the number of splits each row used."""

    out: torch.Tensor
    lse: torch.Tensor
    active: torch.Tensor

    @property
    def num_splits(self) -> int:
        return self.out.shape[0]


def attention_workspace(
    num_splits: int, max_tokens: int, num_heads: int, head_dim: int, device: torch.device
) -> AttentionWorkspace:
    """Allocates a split-KV workspace for up to max_tokens query rows (allocate once, outside
    graph capture)."""
    return AttentionWorkspace(
        out=torch.empty(
            num_splits, max_tokens, num_heads, head_dim, dtype=torch.float32, device=device
        ),
        lse=torch.empty(num_splits, max_tokens, num_heads, dtype=torch.float32, device=device),
        active=torch.empty(max_tokens, dtype=torch.int32, device=device),
    )


def default_num_splits(
    num_requests: int, num_kv_heads: int, max_kv: int, num_sms: int = 132, max_splits: int = 16
) -> int:
    """A static split count for a decode-like launch (max_q 1): enough programs to cover the
    GPU's multiprocessors about twice, and no more than max_kv has MIN_SPLIT_KV positions. For a
    captured graph pass the longest context the graph will serve: at run time each request uses
    only the splits its own context fills. A host-side heuristic, not yet tuned on hardware."""
    programs = max(1, num_requests * num_kv_heads)
    want = max(1, (2 * num_sms + programs - 1) // programs)
    by_length = max(1, triton.cdiv(max_kv, MIN_SPLIT_KV))
    return max(1, min(want, by_length, max_splits))


@dataclass(frozen=True)
class _Config:
    block_q: int  # query tokens per program
    block_m: int  # tile rows: block_q tokens x GROUP heads, a power of two >= 16 (tl.dot)
    block_n: int  # kv positions per tile
    num_warps: int
    num_stages: int = 2
    fp8_words: bool = False  # an fp8 cache read in words (FP8_WORDS)


def _config(
    dtype: torch.dtype, head_dim: int, max_q: int, group: int, kv_fp8: bool = False
) -> _Config:
    """Tile shapes per case, checked free of register spills on sm_90 (Triton 3.6, compiled
    ahead of time). float32 dots run as exact FMA ("ieee"), so their tiles are smaller. A
    one-byte cache read in words (decode) takes 128 positions a tile in three stages, which
    measured faster than bf16's 64 in two; its other tiles are bf16's (128 positions there made
    the W1 job slower; docs/benchmarks.md, Kernel tuning)."""
    if dtype == torch.float32:
        max_rows, block_n, wide_at = max(16, 4096 // head_dim), 16, 4096
    elif head_dim > 128:
        max_rows, block_n, wide_at = 64, 32, 64 * 256
    else:
        max_rows, block_n, wide_at = 128, 64, 128 * 128
    rows = triton.next_power_of_2(max(1, max_q) * group)
    block_m = min(max(16, rows), max(max_rows, triton.next_power_of_2(group)))
    block_q = max(1, min(triton.next_power_of_2(max(1, max_q)), block_m // group))
    num_warps = 8 if block_m * head_dim >= wide_at else 4
    words = fp8_words(kv_fp8, head_dim, block_m)
    if words and block_n == 64:  # 16-bit dots, head_dim <= 128
        return _Config(block_q, block_m, 128, num_warps, num_stages=3, fp8_words=True)
    return _Config(block_q, block_m, block_n, num_warps, fp8_words=words)


def fp8_words(fp8: bool, head_dim: int, block_m: int) -> bool:
    """Whether the kernel reads an fp8 cache's tiles in words (FP8_WORDS): for the dots that
    take register operands (under 64 rows: decode), whose halved columns still make a dot's
    16: Triton reads such a tile's operand from shared memory a byte at a time otherwise. The
    other dots keep byte reads: words for every tile made the W1 job slower (docs/benchmarks.md,
    Kernel tuning)."""
    return fp8 and head_dim >= 32 and block_m < 64


def _combine_blocks(num_splits: int, num_heads: int) -> tuple[int, int]:
    """The combine's (BLOCK_S, BLOCK_H): about 16 partial rows of D per program, a few vector
    loads per thread, so that a small batch's rows x head blocks still spread over the GPU."""
    block_s = triton.next_power_of_2(num_splits)
    return block_s, max(1, min(triton.next_power_of_2(num_heads), 16 // block_s))


def _fp8_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> bool:
    """Whether the caches are FP8 (then kv_scale must hold their two scales)."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 != (v_cache.dtype == torch.float8_e4m3fn):
        raise ValueError("the K and V caches need one dtype")
    if fp8 and (
        kv_scale is None
        or kv_scale.shape != (2,)
        or kv_scale.dtype != torch.float32
        or not kv_scale.is_contiguous()
    ):
        raise ValueError("FP8 caches need kv_scale: [2] float32, K's and V's scales")
    return fp8


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    kv_lens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    max_q: int,
    out: torch.Tensor | None = None,
    window: int | None = None,
    num_splits: int = 1,
    workspace: AttentionWorkspace | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_split_kv: int = MIN_SPLIT_KV,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attends the packed query rows over the paged K/V cache (which already holds this step's
    K/V); writes and returns `out` [T, Hq, D] in q's dtype.

    q [T, Hq, D]; k_cache/v_cache [num_pages, page_size, Hkv, D] (last dim contiguous, q's dtype
    or float8_e4m3fn with kv_scale, [2] float32: K's and V's scales); cu_q [R+1] int32; kv_lens
    [R] int32; page_table [R, max_pages] int32 (entries past a request's pages are never read).
    max_q is a host int >= every request's q_len (static per captured graph: 1 for decode, B for
    verify or the draft block). Hq % Hkv == 0; D a power of two >= 16. window: a row at position
    q sees only positions > q - window (None: all). num_splits > 1 needs a workspace with at
    least that many splits and T rows; it is a maximum: each block of query rows uses one split
    per min_split_kv positions it sees. Allocates nothing when `out` is given.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_requests = kv_lens.shape[0]
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} must be a power of two >= 16")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q and the caches need a contiguous last dimension")
    if min_split_kv < 1:
        raise ValueError(f"min_split_kv {min_split_kv} must be positive")
    if window is not None and window < 1:
        raise ValueError(f"window {window} must be positive")
    fp8 = _fp8_cache(k_cache, v_cache, kv_scale)
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_requests == 0 or max_q <= 0:
        return out
    group = num_heads // num_kv_heads
    cfg = _config(q.dtype, head_dim, max_q, group, fp8)
    q_blocks = triton.cdiv(max_q, cfg.block_q)
    interp = interpreting(q)
    if num_splits > 1:
        if workspace is None or workspace.num_splits < num_splits:
            raise ValueError(f"num_splits={num_splits} needs a workspace of as many splits")
        if workspace.out.shape[1] < num_tokens:
            raise ValueError("the workspace has fewer rows than q")
        part_out, part_lse, active = workspace.out, workspace.lse, workspace.active
    else:
        part_out, part_lse, active = out, out, cu_q  # unused
    grid = (num_requests * q_blocks, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        active,
        cu_q,
        kv_lens,
        page_table,
        kv_scale if fp8 else kv_lens,  # unread without fp8
        scale * _LOG2E,
        q_blocks,
        window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=cfg.block_m,
        BLOCK_N=block_n or cfg.block_n,
        CAUSAL=causal,
        WINDOWED=window is not None,
        NUM_SPLITS=num_splits,
        MIN_SPLIT_KV=min_split_kv,
        DOT_F32=interp or q.dtype == torch.float32,
        PRECISION=_dot_precision(torch.float32 if interp else q.dtype),
        KV_FP8=fp8,
        FP8_WORDS=cfg.fp8_words,
        num_warps=num_warps or cfg.num_warps,
        num_stages=num_stages or cfg.num_stages,
    )
    if num_splits > 1:
        block_s, block_h = _combine_blocks(num_splits, num_heads)
        _combine_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            out,
            part_out,
            part_lse,
            active,
            cu_q,
            num_requests,
            out.stride(0),
            out.stride(1),
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_S=block_s,
            BLOCK_H=block_h,
            num_warps=4,
        )
    return out


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_index_ptr,
    kv_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcp,
    stride_kcs,
    stride_kch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    index = tl.load(kv_index_ptr + t).to(tl.int64)
    if index < 0:
        return
    page = index // PAGE_SIZE
    off = index % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < NUM_HEADS)[:, None]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if KV_FP8:
        # x / scale as torch divides (IEEE, not the GPU's faster approximate division).
        k = tl.math.div_rn(k.to(tl.float32), tl.load(kv_scale_ptr))
        v = tl.math.div_rn(v.to(tl.float32), tl.load(kv_scale_ptr + 1))
        k = e4m3_rounded(tl.clamp(k, -448.0, 448.0))
        v = e4m3_rounded(tl.clamp(v, -448.0, 448.0))
    tl.store(
        k_cache_ptr
        + page * stride_kcp
        + off * stride_kcs
        + offs_h[:, None] * stride_kch
        + offs_d[None, :],
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_cache_ptr
        + page * stride_vcp
        + off * stride_vcs
        + offs_h[:, None] * stride_vch
        + offs_d[None, :],
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_index: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Stores rows k, v [T, Hkv, D] into the caches [num_pages, page_size, Hkv, D] at
    kv_index [T] int64 (page * page_size + offset); rows with a negative index are padding
    and write nothing. D is a power of two; last dims contiguous. FP8 caches store
    x / kv_scale (K's, V's), saturated to +-448 and rounded to nearest even."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} must be a power of two")
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k, v and the caches need a contiguous last dimension")
    fp8 = _fp8_cache(k_cache, v_cache, kv_scale)
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        kv_index,
        kv_scale if fp8 else kv_index,  # unread without fp8
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        KV_FP8=fp8,
        num_warps=4,
    )

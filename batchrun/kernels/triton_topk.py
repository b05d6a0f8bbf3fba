"""Row-wise top-K over a vocabulary of logits ([N, V], V up to 2^31 - 1, any V) in two launches
that read the row once, plus K small groups again: torch.topk's values exactly, with indices
that point at them.

Each element becomes one int64 rank key: its float32 bits made order-preserving in the high word
(-0.0 read as +0.0; every NaN as the positive quiet NaN, above +inf, where torch.topk ranks NaN),
2^31 - 1 - its index in the low word. Keys are unique per row, so Triton's bitonic tl.topk over
keys selects elements and names them at once, and masked slots take a key below every element's.

The row is cut into aligned groups of _GROUP elements, a group ranked by its best key. The top K
elements lie in the top K groups (each group above an element's own holds a distinct element
above it), and a chunk's top K groups hold every global top-K group of that chunk. So
  stage 1, a program per (row, chunk of CHUNK elements): each group's best key (an integer max),
           then the top K of those: the chunk's K best groups, into a fixed [N, chunks, K] buffer;
  stage 2, a program per row: the top K of its chunks' groups, those groups' K * _GROUP elements
           read again, and the top K of them: the row's top K, decoded.
The selections run on tiles of CHUNK / _GROUP keys or fewer; the whole row meets only the
conversion to keys and the group maxima (on sm_90, ~15 instructions an element). Shapes and the
grid follow from N, V and K alone and nothing is read back to the host, so both launches capture
in a CUDA graph.

Ties: equal values rank the lower index first (the larger low word). torch.topk documents no
order among ties; any consistent one is lossless for DFlash2, whose walk reads the candidates in
the order given here (its q is over exactly these candidates, in this order) and whose verify
decides every output token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MAX_K", "supports_k", "topk_triton"]

MAX_K = 64  # the selections' tiles stay small; DFlash2 publishes K = 16
_GROUP = 16  # elements ranked together by their best key in stage 1
_CHUNK = 4096  # elements per stage-1 program: ~40 programs per row at a 152k vocabulary
_WARPS = 4  # both stages'
_LOWEST: tl.constexpr = tl.constexpr(-(2**63))  # below every element's key: masked out


def supports_k(k: int) -> bool:
    """Whether the kernel takes this K: a power of two, 1 .. MAX_K."""
    return 1 <= k <= MAX_K and k & (k - 1) == 0


@triton.jit
def _rank_keys(x, index):
    """Unique int64 keys that order elements as torch.topk does, lower index first on ties."""
    x = x.to(tl.float32)
    x = tl.where(x == 0, 0.0, x)  # -0.0 == +0.0: one key for both
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x != x, 0x7FC00000, bits)  # any NaN: the positive one, above +inf
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negatives: larger magnitude, smaller key
    return (bits.to(tl.int64) << 32) | (0x7FFFFFFF - index).to(tl.int64)


@triton.jit
def _key_index(key):
    return 0x7FFFFFFF - (key & 0x7FFFFFFF)


@triton.jit
def _key_value(key):
    bits = (key >> 32).to(tl.int32)
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # the same map undoes itself
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _chunk_groups_kernel(
    x_ptr,
    groups_ptr,
    V,
    s_xn,
    s_xv,
    s_gn,
    s_gc,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    GROUP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    index = chunk * CHUNK + tl.arange(0, CHUNK // GROUP)[:, None] * GROUP
    index = index + tl.arange(0, GROUP)[None, :]
    inside = index < V
    x = tl.load(x_ptr + row * s_xn + index.to(tl.int64) * s_xv, mask=inside, other=0.0)
    keys = tl.where(inside, _rank_keys(x, index), _LOWEST)
    top = tl.topk(tl.max(keys, axis=1), K)
    tl.store(groups_ptr + row * s_gn + chunk * s_gc + tl.arange(0, K), top)


@triton.jit
def _row_topk_kernel(
    x_ptr,
    groups_ptr,
    values_ptr,
    indices_ptr,
    V,
    C,
    s_xn,
    s_xv,
    s_gn,
    s_vn,
    s_in,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_C)
    group_keys = tl.load(groups_ptr + row * s_gn + slots, mask=slots < C * K, other=_LOWEST)
    best_groups = tl.topk(group_keys, K)
    # A group's best key names its best element, hence the group.
    starts = _key_index(best_groups) // GROUP * GROUP
    index = starts[:, None] + tl.arange(0, GROUP)[None, :]
    inside = (best_groups != _LOWEST)[:, None] & (index < V)
    x = tl.load(x_ptr + row * s_xn + index * s_xv, mask=inside, other=0.0)
    keys = tl.where(inside, _rank_keys(x, index), _LOWEST)
    top = tl.topk(tl.reshape(keys, [K * GROUP]), K)
    ranks = tl.arange(0, K)
    tl.store(values_ptr + row * s_vn + ranks, _key_value(top).to(values_ptr.dtype.element_ty))
    tl.store(indices_ptr + row * s_in + ranks, _key_index(top))


def topk_triton(
    logits: torch.Tensor, k: int, *, chunk: int = _CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] (a float dtype, V >= k) -> (values [..., k] in logits' dtype, descending;
    indices [..., k] int64), as torch.topk(logits, k, dim=-1). k: supports_k. chunk: elements
    per stage-1 program, a power of two (smaller only to test several chunks on a small V),
    raised to k * _GROUP."""
    *lead, v = logits.shape
    if not supports_k(k):
        raise ValueError(f"top-K kernel: k must be a power of two in 1..{MAX_K}, not {k}")
    if not k <= v < 2**31:
        raise ValueError(f"top-K kernel: needs k <= V < 2^31, got k {k}, V {v}")
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"top-K kernel: chunk must be a power of two, not {chunk}")
    rows = logits.reshape(-1, v)
    n = rows.shape[0]
    values = torch.empty(n, k, dtype=logits.dtype, device=logits.device)
    indices = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    if n > 0:
        # tl.topk needs K groups a chunk; a chunk past a small row only masks loads.
        chunk = max(min(chunk, triton.next_power_of_2(v)), k * _GROUP)
        chunks = triton.cdiv(v, chunk)
        groups = torch.empty(n, chunks, k, dtype=torch.int64, device=logits.device)
        _chunk_groups_kernel[(n, chunks)](
            rows, groups, v, *rows.stride(), groups.stride(0), groups.stride(1),
            K=k, CHUNK=chunk, GROUP=_GROUP, num_warps=_WARPS,
        )  # fmt: skip
        _row_topk_kernel[(n,)](
            rows, groups, values, indices, v, chunks, *rows.stride(), groups.stride(0),
            values.stride(0), indices.stride(0),
            K=k, GROUP=_GROUP, BLOCK_C=triton.next_power_of_2(chunks * k), num_warps=_WARPS,
        )  # fmt: skip
    return values.view(*lead, k), indices.view(*lead, k)

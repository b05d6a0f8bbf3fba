"""The candidate selector's proposal walk of DFlash2 drafts in one launch: one program per row,
its P draft positions in a loop inside (each position's edge needs the token chosen at the one
before), each position's K candidates x R selector rank as one tile, accumulated in float32.
Token for token what the DFlash2 method's walk_torch (its walk.py) computes, up to float32
summation order (so the same greedy tokens unless two edge scores differ in their last bits), and
the same rules: ties to the lower candidate index, inverse CDF scaled by the row's own total.

Given the rows' seeds and first steps instead of uniforms, the kernel draws each sampled
position's uniform itself (sampling/draft_verify.py's proposal stream, bit for bit): the torch
Philox is some eight int64 kernels a drafting step, 3% of a round at batch 1 on an H100
(bench/results/jobs-h100-b1-w2-dflash2-profile.json).

The grid and every tensor are sized from shapes only and the kernel reads nothing back to the
host, so it captures in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.sampling.draft_verify import PROPOSAL_STREAM
from batchrun.sampling.triton_sampling import stream_uniform
from batchrun.spec_decode.dflash2.walk import WalkInputs

__all__ = ["walk_triton"]

_PROPOSAL_STREAM = tl.constexpr(PROPOSAL_STREAM)  # a kernel reads only constexpr globals
_MAX_BLOCK_R = 256  # a 16 x 256 float32 tile per loop step: the real selector's rank in one


@triton.jit
def _walk_kernel(
    unary_ptr,
    cand_ptr,
    hproj_ptr,
    anchors_ptr,
    pred_ptr,
    succ_ptr,
    temp_ptr,
    u_ptr,
    seed_ptr,
    step_ptr,
    tokens_ptr,
    q_ptr,
    P,
    K,
    R,
    s_an,
    s_t,
    s_un,
    s_up,
    s_uk,
    s_cn,
    s_cp,
    s_ck,
    s_hn,
    s_hp,
    s_hr,
    s_pv,
    s_pr,
    s_sv,
    s_sr,
    s_rn,
    s_rp,
    s_tn,
    s_tp,
    s_qn,
    s_qp,
    s_qk,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DRAW: tl.constexpr,  # draw the uniforms from seed_ptr, step_ptr (else read u_ptr)
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(temp_ptr + row * s_t)
    sampled = t > 0
    inv_t = 1.0 / tl.where(sampled, t, 1.0)  # greedy rows' softmax is computed and unused
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    rs = tl.arange(0, BLOCK_R)
    previous = tl.load(anchors_ptr + row * s_an).to(tl.int64)
    if DRAW:
        seed = tl.load(seed_ptr + row).to(tl.int64)
        first_step = tl.load(step_ptr + row).to(tl.int64)
    for j in range(P):
        cand = tl.load(cand_ptr + row * s_cn + j * s_cp + ks * s_ck, mask=kmask, other=0)
        cand = cand.to(tl.int64)
        edge = tl.zeros([BLOCK_K], tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r = r0 + rs
            rmask = r < R
            a = tl.load(pred_ptr + previous * s_pv + r * s_pr, mask=rmask, other=0.0)
            h = tl.load(hproj_ptr + row * s_hn + j * s_hp + r * s_hr, mask=rmask, other=0.0)
            context = a.to(tl.float32) * h.to(tl.float32)
            b = tl.load(
                succ_ptr + cand[:, None] * s_sv + r[None, :] * s_sr,
                mask=kmask[:, None] & rmask[None, :],
                other=0.0,
            )
            edge += tl.sum(b.to(tl.float32) * context[None, :], axis=1)
        unary = tl.load(unary_ptr + row * s_un + j * s_up + ks * s_uk, mask=kmask, other=0.0)
        score = tl.where(kmask, edge + unary.to(tl.float32), float("-inf"))
        greedy = tl.argmax(score, axis=0, tie_break_left=True)
        z = score * inv_t
        e = tl.where(kmask, tl.exp(z - tl.max(z, axis=0)), 0.0)
        soft = e / tl.sum(e, axis=0)
        cdf = tl.cumsum(soft, axis=0)
        total = tl.max(tl.where(kmask, cdf, 0.0), axis=0)
        if DRAW:
            u = stream_uniform(seed, first_step + j, _PROPOSAL_STREAM)
        else:
            u = tl.load(u_ptr + row * s_rn + j * s_rp)
        below = (cdf < u * total) & kmask
        drawn = tl.minimum(tl.sum(below.to(tl.int32), axis=0), K - 1)
        choice = tl.where(sampled, drawn, greedy)
        q = tl.where(sampled, soft, (ks == greedy).to(tl.float32))
        tl.store(q_ptr + row * s_qn + j * s_qp + ks * s_qk, q, mask=kmask)
        previous = tl.sum(tl.where(ks == choice, cand, 0), axis=0)
        tl.store(tokens_ptr + row * s_tn + j * s_tp, previous)


def walk_triton(
    inputs: WalkInputs,
    uniforms: torch.Tensor | None = None,
    *,
    seed: torch.Tensor | None = None,
    first_step: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """walk_torch's arguments and results (tokens [N, P] int64, q [N, P, K] float32), any
    strides, the codebooks in any float dtype; instead of `uniforms`, the rows' seed and
    first_step [N] int64 (contiguous): the kernel draws proposal_uniforms(seed, first_step, P)."""
    unary, candidates, hidden_proj, anchors, predecessor, successor, temperature = inputs
    n, p, k = unary.shape
    r = hidden_proj.shape[-1]
    draw = uniforms is None
    if uniforms is None:
        assert seed is not None and first_step is not None, "uniforms or seed and first_step"
        uniforms = unary  # unread: its strides fill the unused arguments
    else:
        seed = first_step = anchors  # unread
    tokens = torch.empty(n, p, dtype=torch.int64, device=unary.device)
    q = torch.empty(n, p, k, dtype=torch.float32, device=unary.device)
    if n == 0 or p == 0:
        return tokens, q
    _walk_kernel[(n,)](
        unary,
        candidates,
        hidden_proj,
        anchors,
        predecessor,
        successor,
        temperature,
        uniforms,
        seed,
        first_step,
        tokens,
        q,
        p,
        k,
        r,
        anchors.stride(0),
        temperature.stride(0),
        *unary.stride(),
        *candidates.stride(),
        *hidden_proj.stride(),
        *predecessor.stride(),
        *successor.stride(),
        *uniforms.stride()[:2],
        *tokens.stride(),
        *q.stride(),
        BLOCK_K=triton.next_power_of_2(k),
        BLOCK_R=min(triton.next_power_of_2(r), _MAX_BLOCK_R),
        DRAW=draw,
        num_warps=4,
    )
    return tokens, q

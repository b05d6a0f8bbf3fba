"""The math of a Gated DeltaNet layer, in plain torch, over B sequences at once: the causal
depthwise conv with its carried inputs, and the gated delta rule over a float32 state
[B, H, dk, dv], recurrent (token by token) or chunked (transformers' chunk algorithm: a UT
transform per chunk of 64 rows, then one scan over the chunks). Both rules compute

    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - k_t^T S_t))^T;  o_t = S_t^T q_t

q and k come L2-normalised, q scaled by dk^-0.5, with their heads repeated to v's (prepare_qkv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def causal_conv(
    x: torch.Tensor,  # [B, L, C] the pre-conv rows
    carried: torch.Tensor,  # [B, C, K - 1] the K - 1 inputs before them (zeros at a start)
    weight: torch.Tensor,  # [C, K]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(conv) [B, L, C] in x's dtype, the window [B, K - 1 + L, C] of inputs it read:
    its last K - 1 rows are the conv state after the L rows, rows n .. n + K - 2 after n)."""
    k = weight.shape[1]
    window = torch.cat((carried.transpose(1, 2).to(x.dtype), x), dim=1)
    taps = window.unfold(1, k, 1)  # [B, L, C, K]
    out = (taps.float() * weight.float()).sum(-1)
    return F.silu(out).to(x.dtype), window


def prepare_qkv(
    mixed: torch.Tensor,  # [B, L, 2 * Hk * dk + Hv * dv] the conv's output
    num_k_heads: int,
    head_k_dim: int,
    num_v_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [B, L, Hv, dk] and v [B, L, Hv, dv] in float32, as the rule takes them."""
    b, length = mixed.shape[:2]
    key_dim = num_k_heads * head_k_dim
    q, k, v = mixed.float().split((key_dim, key_dim, mixed.shape[-1] - 2 * key_dim), dim=-1)
    q, k = (_l2norm(t.reshape(b, length, num_k_heads, head_k_dim)) for t in (q, k))
    repeat = num_v_heads // num_k_heads  # each q/k head serves `repeat` consecutive v heads
    q, k = (t.repeat_interleave(repeat, dim=2) if repeat > 1 else t for t in (q, k))
    return q * head_k_dim**-0.5, k, v.reshape(b, length, num_v_heads, -1)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_rule(
    q: torch.Tensor,  # [B, L, H, dk] float32
    k: torch.Tensor,
    v: torch.Tensor,  # [B, L, H, dv] float32
    g: torch.Tensor,  # [B, L, H] float32, log decay (<= 0)
    beta: torch.Tensor,  # [B, L, H] float32
    state: torch.Tensor,  # [B, H, dk, dv] float32, read only
    keep: torch.Tensor | None = None,  # [B, L] bool: rows whose update the state keeps
) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs [B, L, H, dv] float32, the state after the kept rows). A row not kept still
    has its output; the state passes it by as if it were not there (keep must be a prefix)."""
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        s = state * g[:, t].exp()[..., None, None]
        read = (s * k[:, t, :, :, None]).sum(dim=-2)
        delta = (v[:, t] - read) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = (s * q[:, t, :, :, None]).sum(dim=-2)
        state = s if keep is None else torch.where(keep[:, t, None, None, None], s, state)
    return out, state


def chunked_rule(
    q: torch.Tensor,  # as recurrent_rule's, every sequence of the same length L
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,  # [B, H, dk, dv] float32, read only
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """recurrent_rule's (outputs, final state) in chunks: the prefill form."""
    length = q.shape[1]
    pad = (chunk - length % chunk) % chunk
    # [B, H, chunks, chunk, d]: padded rows have beta 0 and g 0, so they change nothing.
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(1, 2) for x in (g, beta))
    b, h, total = q.shape[:3]
    q, k, v = (x.reshape(b, h, total // chunk, chunk, -1) for x in (q, k, v))
    g, beta = (x.reshape(b, h, total // chunk, chunk) for x in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    decay = g.cumsum(dim=-1)  # log of the decay from the chunk's start to each row
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # The UT transform: within a chunk, the delta rule's updates solved as one triangular system.
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decay = torch.linalg.solve_triangular(
        system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * pairwise
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_v)
    for i in range(total // chunk):
        corrected = new_v[:, :, i] - k_decay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ corrected
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ corrected
    out = out.reshape(b, h, total, -1)[:, :, :length].transpose(1, 2)
    return out, state


def conv_rows(
    qkv: torch.Tensor,  # [D, W, C] each request's W pre-conv rows
    conv: torch.Tensor,  # [num_slots, C, K - 1] the slots' carried inputs
    slots: torch.Tensor,  # [D] int64
    weight: torch.Tensor,  # [C, K]
    keep: torch.Tensor | None,  # [D] int64: rows whose inputs the slot takes (None: read only)
) -> torch.Tensor:
    """causal_conv of each request's rows from its slot's carried inputs: silu(conv) [D, W, C].
    With `keep`, each slot then carries the K - 1 inputs before row keep[r] (after rows
    0 .. keep[r] - 1): a decode step keeps W, a verify's commit the accepted rows."""
    mixed, window = causal_conv(qkv, conv[slots], weight)
    if keep is not None:
        rows = keep[:, None] + torch.arange(weight.shape[1] - 1, device=qkv.device)
        picked = window.gather(1, rows[..., None].expand(-1, -1, window.shape[-1]))
        conv[slots] = picked.transpose(1, 2)
    return mixed


def delta_rows(
    mixed: torch.Tensor,  # [D, W, C] conv_rows' output
    g: torch.Tensor,  # [D, W, Hv] float32
    beta: torch.Tensor,  # [D, W, Hv] float32
    recurrent: torch.Tensor,  # [num_slots, Hv, dk, dv] float32
    slots: torch.Tensor,  # [D] int64
    keep: torch.Tensor | None,  # [D] int64: rows whose updates the slot takes (None: read only)
    num_k_heads: int,
    head_k_dim: int,
) -> torch.Tensor:
    """recurrent_rule over each request's rows from its slot's state: outputs [D, W, Hv, dv] in
    mixed's dtype. With `keep`, each slot then holds the state after rows 0 .. keep[r] - 1 (the
    outputs of later rows are then not the rule's: a commit drops them)."""
    q, k, v = prepare_qkv(mixed, num_k_heads, head_k_dim, g.shape[-1])
    kept = None
    if keep is not None:
        kept = torch.arange(mixed.shape[1], device=mixed.device)[None] < keep[:, None]
    out, final = recurrent_rule(q, k, v, g, beta, recurrent[slots], kept)
    if keep is not None:
        recurrent[slots] = final
    return out.to(mixed.dtype)


def prefill_chunks(
    qkv: torch.Tensor,  # [N, C] the chunks' packed pre-conv rows
    g: torch.Tensor,  # [N, Hv] float32
    beta: torch.Tensor,  # [N, Hv] float32
    conv: torch.Tensor,  # [num_slots, C, K - 1]
    recurrent: torch.Tensor,  # [num_slots, Hv, dk, dv] float32
    slots: torch.Tensor,  # [P] int64: each chunk's slot
    lens: tuple[int, ...],  # host: each chunk's rows, in order
    weight: torch.Tensor,  # [C, K]
    num_k_heads: int,
    head_k_dim: int,
) -> torch.Tensor:
    """Each prefill chunk from its slot's states, chunked_rule one chunk at a time (chunks differ
    in length): outputs [N, Hv, dv] in qkv's dtype; each slot then holds the state after its
    chunk."""
    out = qkv.new_empty((qkv.shape[0], *recurrent.shape[1:2], recurrent.shape[-1]))
    carried, start = weight.shape[1] - 1, 0
    for p, length in enumerate(lens):
        rows, slot = slice(start, start + length), slots[p : p + 1]
        mixed, window = causal_conv(qkv[None, rows], conv[slot], weight)
        q, k, v = prepare_qkv(mixed, num_k_heads, head_k_dim, g.shape[-1])
        o, final = chunked_rule(q, k, v, g[None, rows], beta[None, rows], recurrent[slot])
        conv[slot] = window[:, window.shape[1] - carried :].transpose(1, 2)
        recurrent[slot] = final
        out[rows] = o[0].to(qkv.dtype)
        start += length
    return out

"""A Gated DeltaNet layer (the linear-attention layers of Qwen3.5 and Qwen3-Next) over a packed
step of many requests, each request's state in a slot of the layer's LinearLayerState.

A step packs decode/verify rows first: requests [0, decoding), each its own W_r rows (1 is plain
decoding) after those of the requests before it, then prefill chunks. Prefill chunks and plain
decode rows update their slots in place. In a verify step (some W_r > 1) every decoding
request's rows, laid out on a [decoding, max_q] grid, read their slots and write nothing there:
the layer keeps, per verify row, what a replay needs (the pre-conv qkv row, g, beta) in the
state's scratch, and `commit`, once acceptance is known, replays the kept rows from the slot's
state and writes the result.
A rejected draft so leaves no trace, and verification costs O(W) per-token rows per request,
no copy of the state.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.attention.meta import padded_rows, row_starts
from batchrun.layers.norm import GatedRMSNorm
from batchrun.layers.ops import TORCH_OPS


@dataclass(frozen=True)
class LinearStepMeta:
    """What the linear layers need of one packed step (its rows as AttentionMeta's cu_q packs
    them: the decoding requests' rows, then each prefill chunk's; rows past them are padding,
    read by no state and given zeros)."""

    slots: torch.Tensor  # [R] int64 on the device: each request's state slot
    decoding: int  # requests [0, decoding) decode or verify, q_lens[r] rows each
    q_lens: torch.Tensor  # [decoding] int64 on the device: each decoding request's rows
    max_q: int  # host: the most rows a decoding request has; > 1 is a verify step (see commit)
    decode_rows: int  # host: the rows the decoding requests lead the step with (a graph's padded)
    prefill_lens: tuple[int, ...] = ()  # host: the rows of each prefill chunk, in step order
    prefill_fresh: tuple[bool, ...] = ()  # host: chunk starts its request (zero state)

    @property
    def verify(self) -> bool:
        return self.max_q > 1 and self.decoding > 0

    # Built once a step on the device, for every linear layer (cached on the frozen instance).
    @cached_property
    def prefill_cu(self) -> torch.Tensor:
        """[P + 1] int32: the prefill chunks' row offsets within the prefill rows."""
        offsets = [0]
        for length in self.prefill_lens:
            offsets.append(offsets[-1] + length)
        return torch.tensor(offsets, dtype=torch.int32).to(self.slots.device, non_blocking=True)

    @cached_property
    def fresh_slots(self) -> torch.Tensor:
        """The slots of the chunks that start their request (their state starts at zero)."""
        fresh = [self.decoding + i for i, f in enumerate(self.prefill_fresh) if f]
        return self.slots[torch.tensor(fresh, dtype=torch.int64).to(self.slots.device)]


@dataclass
class LinearLayerState:
    """One linear layer's per-request state: a slot per request, and the scratch a verify step
    fills for `commit` (indexed by the request's place among the decoding ones)."""

    conv: torch.Tensor  # [num_slots, conv_dim, K - 1] model dtype: the last K - 1 inputs
    recurrent: torch.Tensor  # [num_slots, Hv, dk, dv] float32
    scratch_qkv: torch.Tensor  # [max_decoding, max_width, conv_dim] model dtype
    scratch_g: torch.Tensor  # [max_decoding, max_width, Hv] float32
    scratch_beta: torch.Tensor  # [max_decoding, max_width, Hv] float32


class _ConvWeight(nn.Module):
    """Holds conv1d.weight [conv_dim, 1, K] under the checkpoint's name (no nn.Conv1d: the
    layer convolves packed requests itself)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class GatedDeltaNet(nn.Module):
    # Checkpoint tensors packed into one parameter: name -> (packed name, shard index).
    PACKED = {
        "in_proj_qkv": ("in_proj", 0),
        "in_proj_z": ("in_proj", 1),
        "in_proj_b": ("in_proj", 2),
        "in_proj_a": ("in_proj", 3),
    }

    def __init__(
        self,
        hidden: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
    ) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_dim = 2 * num_k_heads * head_k_dim + self.value_dim
        self.sizes = (self.conv_dim, self.value_dim, num_v_heads, num_v_heads)
        self.in_proj = nn.Linear(hidden, sum(self.sizes), bias=False)
        self.in_proj.shard_sizes = self.sizes  # type: ignore[assignment]
        self.conv1d = _ConvWeight(self.conv_dim, conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.ops = TORCH_OPS  # use_ops swaps in the Triton kernels of its rows and chunks

    def forward(
        self, x: torch.Tensor, state: LinearLayerState, meta: LinearStepMeta
    ) -> torch.Tensor:
        qkv, z, b, a = self.in_proj(x).split(self.sizes, dim=-1)
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        shape = (x.shape[0], self.num_v_heads, self.head_v_dim)
        core = torch.zeros(shape, dtype=x.dtype, device=x.device)
        rows = meta.decode_rows
        if meta.decoding:
            core[:rows] = self._decode(qkv[:rows], g[:rows], beta[:rows], state, meta)
        if meta.prefill_lens:
            core[rows : rows + sum(meta.prefill_lens)] = self._prefill(
                qkv[rows:], g[rows:], beta[rows:], state, meta
            )
        out = self.norm(core, z.reshape(core.shape))
        return self.out_proj(out.reshape(x.shape[0], self.value_dim))

    def _decode(
        self,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: LinearLayerState,
        meta: LinearStepMeta,
    ) -> torch.Tensor:
        d, w = meta.decoding, meta.max_q
        if not meta.verify:  # plain decoding: one row each, the slots take it now
            qkv, g, beta = qkv.view(d, 1, -1), g.view(d, 1, -1), beta.view(d, 1, -1)
            keep = torch.ones(d, dtype=torch.int64, device=qkv.device)
            out = self._rows(qkv, g, beta, state, meta.slots[:d], keep)
            return out.reshape(d, self.num_v_heads, self.head_v_dim)
        # A verify step: each request's rows on a [D, max_q] grid (cells past its rows repeat
        # its last one: every row is causal, so they change none of its own), its slot read
        # only, the grid kept for commit.
        starts = row_starts(meta.q_lens)
        grid, _ = padded_rows(starts, meta.q_lens, w)
        # A graph's padding requests (no rows) start where the live rows end: in range.
        grid = grid.clamp_(max=max(qkv.shape[0] - 1, 0))
        qkv, g, beta = qkv[grid], g[grid], beta[grid]
        # A graph's grid is as wide as the job's widest verify: each request's kernels run
        # its own rows only (a width-2 step in a 16-wide grid would run the rule 16 times).
        out = self._rows(qkv, g, beta, state, meta.slots[:d], None, meta.q_lens)
        state.scratch_qkv[:d, :w] = qkv
        state.scratch_g[:d, :w] = g
        state.scratch_beta[:d, :w] = beta
        # Back to the packed rows: row t is request r's row t - starts[r]; rows past the
        # requests' (a graph's padding) get zeros.
        t = torch.arange(meta.decode_rows, device=grid.device)
        ends = starts + meta.q_lens
        req = torch.searchsorted(ends, t, right=True).clamp_(max=max(d - 1, 0))
        col = (t - starts[req]).clamp_(0, w - 1)
        # where, not a product: the cells past a request's rows were never written
        packed = torch.where((t < ends[-1])[:, None, None], out[req, col], 0)
        return packed.reshape(meta.decode_rows, self.num_v_heads, self.head_v_dim)

    def _rows(
        self,
        qkv: torch.Tensor,  # [D, W, conv_dim]
        g: torch.Tensor,  # [D, W, Hv]
        beta: torch.Tensor,
        state: LinearLayerState,
        slots: torch.Tensor,  # [D]
        keep: torch.Tensor | None,  # [D]: rows the slots take (None: they are only read)
        rows: torch.Tensor | None = None,  # [D]: each request's own rows (None: all W)
    ) -> torch.Tensor:
        """The core outputs [D, W, Hv, dv] of decode or verify rows, from the ops' kernels
        (a request's cells past its rows unspecified)."""
        weight = self.conv1d.weight[:, 0]
        mixed = self.ops.conv_rows(qkv, state.conv, slots, weight, keep, rows)
        return self.ops.delta_rows(
            mixed, g, beta, state.recurrent, slots, keep, self.num_k_heads, self.head_k_dim, rows
        )

    def _prefill(
        self,
        qkv: torch.Tensor,  # the prefill rows (and any padding after them)
        g: torch.Tensor,
        beta: torch.Tensor,
        state: LinearLayerState,
        meta: LinearStepMeta,
    ) -> torch.Tensor:
        """Every prefill chunk of the step from its slot's state, the slots updated in place."""
        if any(meta.prefill_fresh):
            state.conv[meta.fresh_slots] = 0
            state.recurrent[meta.fresh_slots] = 0
        n = sum(meta.prefill_lens)
        return self.ops.prefill_chunks(
            qkv[:n],
            g[:n],
            beta[:n],
            state.conv,
            state.recurrent,
            meta.slots[meta.decoding :],
            meta.prefill_lens,
            meta.prefill_cu,
            self.conv1d.weight[:, 0],
            self.num_k_heads,
            self.head_k_dim,
        )

    def commit(self, state: LinearLayerState, meta: LinearStepMeta, accepted: torch.Tensor) -> None:
        """After a verify step: replay rows 0 .. accepted[r] of each decoding request r
        (accepted [decoding] int64 on the device: drafts accepted) from its slot's state, and
        write the states they leave. Nothing to do after other steps (their rows updated the
        slots in the forward)."""
        if not meta.verify:
            return
        d, w = meta.decoding, meta.max_q
        qkv, g, beta = (
            state.scratch_qkv[:d, :w],
            state.scratch_g[:d, :w],
            state.scratch_beta[:d, :w],
        )
        kept = accepted + 1
        self._rows(qkv, g, beta, state, meta.slots[:d], kept, kept)

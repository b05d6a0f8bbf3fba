"""A Gated DeltaNet layer (the linear-attention layers of Qwen3.5 and Qwen3-Next) over a packed
step of many requests, each request's state in a slot of the layer's LinearLayerState.

A step packs decode/verify rows first: requests [0, decoding), each its own W_r rows (1 is plain
decoding) after those of the requests before it, then prefill chunks. Prefill chunks and plain
decode rows update their slots in place. In a verify step (some W_r > 1) no decoding request's
rows enter its slot: the layer keeps, per verify row, what the slot may take once acceptance is
known, and `commit` hands the kept rows over. The conv's carried inputs take them then (the
pre-conv rows, kept in the scratch packed as the step's rows are: a few rows of inputs). The
recurrent state takes them lazily (ops.KeptRows): the slot's next step applies them before its
own rows, in the pass over the state it makes anyway, so a verify round reads and writes the
state once, as a decode step does.
A rejected draft so leaves no trace, and verification costs O(W) per-token rows per request,
no copy of the state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.attention.meta import row_starts
from batchrun.layers.norm import GatedRMSNorm
from batchrun.layers.ops import TORCH_OPS, DecodeRows, KeptRows


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
    def layout(self) -> DecodeRows:
        """The decoding requests' rows (a graph's padding requests have none)."""
        return DecodeRows(row_starts(self.q_lens), self.q_lens, self.max_q)

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
    """One linear layer's per-request state: a slot per request, the pre-conv rows a verify step
    keeps for the conv's `commit` (packed as in the step), and the rows its slots' recurrent
    states take in their next step (`kept`)."""

    conv: torch.Tensor  # [num_slots, conv_dim, K - 1] model dtype: the last K - 1 inputs
    recurrent: torch.Tensor  # [num_slots, Hv, dk, dv] float32
    scratch_qkv: torch.Tensor  # [decode_slots * max_width, conv_dim] model dtype
    kept: KeptRows


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
            self._decode(qkv[:rows], g[:rows], beta[:rows], state, meta, core[:rows])
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
        out: torch.Tensor,  # [decode_rows, Hv, dv] zeros: each request's outputs go to its rows
    ) -> None:
        """The decoding requests' rows through the ops' kernels, each request's own rows only
        (a graph's steps allow the job's widest verify to every request): plain decoding's
        slots take their row now; a verify step's slots take only their pending rows, its own
        kept for commit (the pre-conv rows in the scratch, the rest staged by delta_rows)."""
        slots, rows = meta.slots[: meta.decoding], meta.layout
        keep = None if meta.verify else meta.q_lens
        mixed = self.ops.conv_rows(qkv, state.conv, slots, rows, self.conv1d.weight[:, 0], keep)
        self.ops.delta_rows(
            mixed,
            g,
            beta,
            state.recurrent,
            slots,
            rows,
            state.kept,
            not meta.verify,
            self.num_k_heads,
            self.head_k_dim,
            out,
        )
        if meta.verify:
            state.scratch_qkv[: qkv.shape[0]] = qkv

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

    def commit(self, state: LinearLayerState, meta: LinearStepMeta, kept: torch.Tensor) -> None:
        """After a verify step, kept [decoding] int64 on the device (drafts accepted + 1): each
        decoding request's slot carries the conv inputs after its kept rows. Its recurrent
        state takes them in its next step (the model's commit_linear hands them over)."""
        rows = replace(meta.layout, lens=kept)
        qkv = state.scratch_qkv[: meta.decode_rows]
        slots = meta.slots[: meta.decoding]
        self.ops.conv_rows(qkv, state.conv, slots, rows, self.conv1d.weight[:, 0], kept)

"""A hybrid target's per-request recurrent state (its Gated DeltaNet layers'), hosted beside
the paged KV: one state slot per device-state slot (a request's slot is its state's, taken at
admission and given back at finish), the scratch slot's for padding, what a verify step keeps
for its commit (models/qwen3_5.py declares both, and their bytes), and the snapshot slots of
reused prefixes (core/state_snapshots.py), SNAPSHOTS_PER_REQUEST per request.

Each step's `meta` maps its rows to their slots from the step plan. A prefill chunk at its
request's position 0 starts from zero state, so a slot needs no clearing when a request takes
it, and a later chunk carries the state on. A chunk that starts past a reused prefix (a cache
hit, a sibling's prompt) has its slot restored from the prefix's snapshot first (`restore`),
and a chunk that ends at a stored boundary copies its slot into a snapshot after the forward
(`store`). After a verify step's acceptance, `commit` hands each slot its kept rows, which its
state takes at the start of the slot's next step (layers/ops.py's KeptRows): a rejected draft
leaves no trace. A plain decode step (width 1) updates its slots in the forward, and its commit
does nothing. A request's first step is a prefill chunk, after which its slot has no rows
pending: a finished request's are dropped.
A CUDA graph's step holds padding requests too, in the scratch slot (graph_meta): they have no
rows, so the kernels run nothing for them (at most rewrite that slot as it was), and the
scratch rows past the live requests' are written but never read.
"""

from __future__ import annotations

import torch

from batchrun.attention.base import AttentionBackend
from batchrun.engine.step_inputs import StepArgs, StepPlan
from batchrun.layers.linear_attention import LinearLayerState, LinearStepMeta
from batchrun.models.qwen3 import Qwen3Shape
from batchrun.models.qwen3_5 import (
    LayerCache,
    Qwen3_5ForCausalLM,
    Qwen3_5Shape,
    allocate_linear_states,
    linear_kept_bytes,
    linear_state_bytes,
)

# State snapshots kept per request slot: the pool holds max_batch_size of them, so a full
# batch can each fork or restart from one (more would cost a whole state each).
SNAPSHOTS_PER_REQUEST = 1


def snapshot_slots(num_slots: int) -> int:
    """The snapshot pool's size for num_slots request slots."""
    return SNAPSHOTS_PER_REQUEST * num_slots


def linear_memory_bytes(shape: Qwen3Shape, dtype: torch.dtype, num_slots: int, width: int) -> int:
    """What LinearSlots allocates for num_slots requests (and the scratch slot) verifying up to
    `width` rows each, with their snapshot slots; 0 for a target without linear layers. Memory
    sizing counts it."""
    if not isinstance(shape, Qwen3_5Shape) or not shape.linear_layers:
        return 0
    decode_slots = num_slots + 1
    slots = (decode_slots + snapshot_slots(num_slots)) * linear_state_bytes(shape, dtype)
    return slots + linear_kept_bytes(shape, dtype, decode_slots, width)


class LinearSlots:
    def __init__(
        self,
        model: Qwen3_5ForCausalLM,
        pools: list[tuple[torch.Tensor, torch.Tensor]],
        num_slots: int,
        max_width: int,
        device: torch.device,
    ) -> None:
        """pools: the full-attention layers' K/V, in layer order; num_slots: the device
        state's (its scratch slot gets one too); max_width: the widest verify step (the
        draft's block, else 1). Snapshot j lives in state slot num_slots + 1 + j."""
        self.model = model
        dtype = model.lm_head.weight.dtype
        self.max_decoding = num_slots  # a graph's padded batch is at most the slots'
        self.num_snapshots = snapshot_slots(num_slots)
        self._first_snapshot = num_slots + 1
        total = self._first_snapshot + self.num_snapshots
        # The request slots and the scratch slot decode.
        self.states: dict[int, LinearLayerState] = allocate_linear_states(
            model.shape, total, num_slots + 1, max_width, dtype, device
        )
        left = iter(pools)
        n = model.shape.num_layers
        # The model's per-layer caches: a linear layer's state, a full-attention layer's pool.
        self.caches: list[LayerCache] = [self.states.get(i) or next(left) for i in range(n)]
        assert next(left, None) is None, "one K/V pool per full-attention layer"

    def meta(self, plan: StepPlan, args: StepArgs) -> LinearStepMeta:
        """The step's rows by slot: its decoding requests (each its own rows), then its
        chunks."""
        d = plan.num_decoding
        return LinearStepMeta(
            slots=args.slot,
            decoding=d,
            q_lens=args.q_len[:d],
            max_q=plan.max_width,
            decode_rows=plan.decode_rows,
            prefill_lens=plan.chunk_lens,
            prefill_fresh=plan.chunk_fresh,
        )

    def graph_meta(
        self, slots: torch.Tensor, q_lens: torch.Tensor, max_q: int, rows: int
    ) -> LinearStepMeta:
        """A CUDA graph's step: every one of its requests decodes (slots [size], the padding
        ones the scratch slot's, with no rows), `rows` in all, at most max_q each; its scratch
        rows [:size] filled for the commit, which reads the live ones (`meta`'s), the first of
        them."""
        assert slots.shape[0] <= self.max_decoding, "the verify scratch holds every graph row"
        size = slots.shape[0]
        return LinearStepMeta(
            slots=slots, decoding=size, q_lens=q_lens, max_q=max_q, decode_rows=rows
        )

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        capture_layers: tuple[int, ...],
        meta: LinearStepMeta,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's forward over the step (Qwen3ForCausalLM.forward's outputs)."""
        return self.model(ids, positions, backend, self.caches, capture_layers, linear=meta)

    def restore(self, plan: StepPlan) -> None:
        """Before the step's forward: each (snapshot, slot) of the plan's restores."""
        if plan.restores:
            snapshots, slots = zip(*plan.restores, strict=True)
            self._copy(self._snapshot_slots(snapshots), list(slots))

    def store(self, plan: StepPlan) -> None:
        """After the step's forward: each (slot, snapshot) of the plan's stores."""
        if plan.stores:
            slots, snapshots = zip(*plan.stores, strict=True)
            self._copy(list(slots), self._snapshot_slots(snapshots))

    def _snapshot_slots(self, snapshots: tuple[int, ...]) -> list[int]:
        return [self._first_snapshot + j for j in snapshots]

    def _copy(self, src: list[int], dst: list[int]) -> None:
        """Every linear layer's state slots src -> dst (a gather, then a scatter: one pair of
        kernels per tensor whatever the count)."""
        device = next(iter(self.states.values())).conv.device
        src_t = torch.tensor(src, dtype=torch.int64).to(device, non_blocking=True)
        dst_t = torch.tensor(dst, dtype=torch.int64).to(device, non_blocking=True)
        for state in self.states.values():
            state.conv.index_copy_(0, dst_t, state.conv.index_select(0, src_t))
            state.recurrent.index_copy_(0, dst_t, state.recurrent.index_select(0, src_t))

    def commit(self, meta: LinearStepMeta, accepted: torch.Tensor) -> None:
        """After the step's acceptance (accepted [decoding], on the device): the model's
        commit_linear, which does nothing after a step that verified nothing."""
        self.model.commit_linear(self.caches, meta, accepted)

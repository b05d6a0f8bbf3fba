"""A hybrid target's per-request recurrent state (its Gated DeltaNet layers'), hosted beside
the paged KV: one state slot per device-state slot (a request's slot is its state's, taken at
admission and given back at finish), the scratch slot's for padding, and the verify scratch
commit replays from (models/qwen3_5.py declares both, and their bytes).

Each step's `meta` maps its rows to their slots from the step plan. A prefill chunk that starts
its request's computation (position 0: hybrid targets compute every prompt token, engine.py)
starts from zero state, so a slot needs no clearing when a request takes it, a preempted
request recomputes from scratch, and a later chunk carries the state on. After a verify step's
acceptance, `commit` writes the states the kept rows leave: a rejected draft leaves no trace.
A plain decode step (width 1) updates its slots in the forward, and its commit does nothing.
A CUDA graph's step runs its padding requests too, in the scratch slot (graph_meta): they
write only that slot's state and scratch rows past the live requests', which nothing reads.
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
    linear_scratch_bytes,
    linear_state_bytes,
)


def linear_memory_bytes(shape: Qwen3Shape, dtype: torch.dtype, num_slots: int, width: int) -> int:
    """What LinearSlots allocates for num_slots requests (and the scratch slot) verifying up to
    `width` rows each; 0 for a target without linear layers. Memory sizing counts it."""
    if not isinstance(shape, Qwen3_5Shape) or not shape.linear_layers:
        return 0
    slots = (num_slots + 1) * linear_state_bytes(shape, dtype)
    return slots + num_slots * width * linear_scratch_bytes(shape, dtype)


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
        draft's block, else 1)."""
        self.model = model
        dtype = model.lm_head.weight.dtype
        self.max_decoding = num_slots  # a graph's padded batch is at most the slots'
        self.states: dict[int, LinearLayerState] = allocate_linear_states(
            model.shape, num_slots + 1, num_slots, max_width, dtype, device
        )
        left = iter(pools)
        n = model.shape.num_layers
        # The model's per-layer caches: a linear layer's state, a full-attention layer's pool.
        self.caches: list[LayerCache] = [self.states.get(i) or next(left) for i in range(n)]
        assert next(left, None) is None, "one K/V pool per full-attention layer"

    def meta(self, plan: StepPlan, args: StepArgs) -> LinearStepMeta:
        """The step's rows by slot: its decoding requests (W rows each), then its chunks."""
        return LinearStepMeta(
            slots=args.slot,
            decoding=plan.num_decoding,
            width=plan.width,
            prefill_lens=plan.chunk_lens,
            prefill_fresh=plan.chunk_fresh,
        )

    def graph_meta(self, slots: torch.Tensor, width: int) -> LinearStepMeta:
        """A CUDA graph's step: every one of its requests decodes (slots [size], the padding
        ones the scratch slot's), its scratch rows [:size] filled for the commit, which reads
        the live ones (`meta`'s), the first of them."""
        assert slots.shape[0] <= self.max_decoding, "the verify scratch holds every graph row"
        return LinearStepMeta(slots=slots, decoding=slots.shape[0], width=width)

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

    def commit(self, meta: LinearStepMeta, accepted: torch.Tensor) -> None:
        """After the step's acceptance (accepted [decoding], on the device)."""
        if meta.verify:
            self.model.commit_linear(self.caches, meta, accepted)

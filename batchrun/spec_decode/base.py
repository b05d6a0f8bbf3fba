"""The interface between the engine and speculative decoding. Each step the engine asks its
speculator for each row's verify width (`next_widths`), then for drafts (`propose`), runs the
target over them, hands it the target's features (`observe`) and asks how many drafts the
target's tokens accept (`accept`); inside the target forward, graphs included, the runner passes
it the features of rows already committed (`store_context`).

The runner builds its speculator once, handing it a `TargetView`: the target's model, the
per-slot state and the graph machinery it may use, and nothing else of the runner. The
speculator holds no engine or runner; the runner holds the speculator. `Speculator` itself is
plain decoding: width 1, no drafts, nothing to store (dflash/ is the drafting one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from batchrun.attention.base import AttentionBackend
from batchrun.attention.meta import AttentionMeta
from batchrun.models.qwen3 import Qwen3ForCausalLM
from batchrun.sampling.slot_tables import SlotTables

Outputs = tuple[torch.Tensor, ...]


class SlotState(Protocol):
    """The per-slot device state a speculator reads (engine/device_state.py's)."""

    @property
    def num_slots(self) -> int: ...  # the scratch slot's index: graph padding
    @property
    def page_table(self) -> torch.Tensor: ...  # [slots, max_pages] int32
    @property
    def seq_len(self) -> torch.Tensor: ...  # tokens with target KV: the anchor's position
    @property
    def last_token(self) -> torch.Tensor: ...  # the anchor
    @property
    def out_len(self) -> torch.Tensor: ...  # committed output tokens
    @property
    def sampling(self) -> SlotTables: ...  # each slot's sampling parameters


class StepShape(Protocol):
    """What a speculator reads of a step's plan (engine/step_inputs.py's StepPlan)."""

    @property
    def widths(self) -> tuple[int, ...]: ...  # each decoding request's verify width W_r
    @property
    def max_width(self) -> int: ...  # the widest (1: the step verifies no draft)
    @property
    def decode_slots(self) -> tuple[int, ...]: ...  # each decoding request's slot
    @property
    def num_requests(self) -> int: ...  # R, padded for a graph step
    @property
    def num_live(self) -> int: ...
    @property
    def num_decoding(self) -> int: ...  # D, first in the step
    @property
    def num_rows(self) -> int: ...
    @property
    def max_kv(self) -> int: ...
    @property
    def uniform(self) -> bool: ...  # every live request decodes (graphs' shape)


class ContextRows(Protocol):
    """The rows of a target forward whose draft context is stored as it runs (engine/
    step_inputs.py's TargetInputs)."""

    @property
    def meta(self) -> AttentionMeta: ...
    @property
    def row_slot(self) -> torch.Tensor: ...  # [T]
    @property
    def row_req(self) -> torch.Tensor: ...  # [T]
    @property
    def context_kv_index(self) -> torch.Tensor: ...  # [T], -1: not stored


class Graphs(Protocol):
    """One step function captured at each size of the batch ladder."""

    @property
    def name(self) -> str: ...
    def __contains__(self, size: int) -> bool: ...


class GraphHost(Protocol):
    """The runner's CUDA-graph machinery (engine/cuda_graphs.py), lent to a speculator's graphs:
    they read their requests from the same packed step as the target's."""

    def sizes(self, max_batch_size: int, width: int) -> list[int]:
        """The ladder sizes the target's graphs of `width` are captured at."""
        ...

    def bucket(self, num_requests: int, max_batch_size: int) -> int:
        """The ladder size a batch of num_requests runs at."""
        ...

    def slots(self, size: int) -> torch.Tensor:
        """A graph step's request slots [size], in the packed step."""
        ...

    def capture(
        self,
        name: str,
        fn: Callable[[int], Outputs],
        sizes: list[int],
        planned: tuple[list[AttentionBackend], int],
        pool: Any,
    ) -> Graphs:
        """`fn` captured at each size; planned: the backends it attends with and its query
        rows per request."""
        ...

    def replayable(self, graphs: Graphs | None, step: StepShape) -> bool:
        """Whether `step` replays one of `graphs` (at its num_requests)."""
        ...

    def replay(
        self,
        graphs: Graphs,
        size: int,
        backends: list[AttentionBackend],
        metas: Callable[[], list[AttentionMeta]],
    ) -> Outputs:
        """Replays the graph of `size`; host-planned backends plan it from `metas`."""
        ...


@dataclass(frozen=True)
class TargetView:
    """What a speculator may see of the target's runner, handed once when the runner builds it.
    The tensors are the runner's persistent buffers: a speculator reads them (inside its graphs
    too) and writes none of them."""

    model: Qwen3ForCausalLM  # the target: a draft borrows its embeddings (and head)
    state: SlotState
    device: torch.device
    page_size: int
    num_pages: int  # the target's KV pool (a full-attention draft layer's cache has as many)
    max_kv: int  # positions a step can touch
    max_pages: int  # a page table's columns
    graphs: GraphHost


class Admitted(Protocol):
    """What the hooks read of a request that took a slot."""

    @property
    def row_index(self) -> int: ...


class SpeculationHooks:
    """What a benchmark may change in speculation (batchrun/bench/hooks.py installs its own):
    pin the verify width, or rewrite each step's drafts on the device after the draft's forward
    ran (its cost stays real). These change nothing: `batchrun run` keeps them."""

    pinned_width: int | None = None  # the width every step verifies at (None: the policy's)

    def admit(self, requests: Sequence[Admitted], slots: torch.Tensor) -> None:
        """Requests that just took their slots (`slots`: theirs, on the device)."""

    def rewrite(self, drafts: torch.Tensor, slots: torch.Tensor, out_len: torch.Tensor) -> None:
        """drafts [D, B-1] of the step's decoding requests in `slots` [D], in place; out_len:
        every slot's committed output tokens."""


class Speculator:
    """Plain decoding: every step verifies one row per request (its anchor) and drafts nothing."""

    drafting = False  # it proposes drafts
    block_size = 1  # the rows a decoding request may verify in a step
    widths: tuple[int, ...] = (1,)  # the verify widths it may choose (graphs exist for each)
    capture_layers: tuple[int, ...] = ()  # the target layers whose hidden states it reads
    # Prompt tokens a request computes even where cached pages hold them (at least its last).
    recompute_tail = 1

    def __init__(self) -> None:
        self.hooks = SpeculationHooks()

    @property
    def writes_context(self) -> bool:
        """Whether width-1 steps capture features at capture_layers and store them now."""
        return bool(self.capture_layers)

    def start_job(self, max_batch_size: int, max_batched_tokens: int) -> None:
        """A new job: what it learnt about widths is forgotten."""

    def next_widths(self, slots: Sequence[int], prefill_pending: bool) -> dict[int, int]:
        """The verify width of each running request (by slot) in the next step."""
        return dict.fromkeys(slots, 1)

    def admit(self, requests: Sequence[Admitted], slots: torch.Tensor) -> None:
        """Requests that just took their slots (`slots`: theirs, on the device)."""

    def propose(self, step: StepShape, slots: torch.Tensor) -> torch.Tensor | None:
        """The step's drafts [D, B-1] for its D decoding requests, of which request r verifies
        its first W_r - 1 (None: it verifies none); slots: the step's request slots [R],
        decoding ones first."""
        return None

    def graph_drafts(self, size: int) -> torch.Tensor | None:
        """The buffer a target graph of `size` requests reads its drafts from."""
        return None

    def store_context(self, features: torch.Tensor, rows: ContextRows) -> None:
        """Inside the target forward: features of the rows it already commits (prefill chunks;
        in a step that verifies no draft every row), for the draft's context."""

    def observe(self, features: torch.Tensor | None) -> None:
        """The target forward's features (its rows at capture_layers), the next draft's context."""

    def proposal(self, step: StepShape) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The distribution the step's drafts were sampled from, for the verify to sample its
        tokens against (sampling/draft_verify.py): q and the candidate ids it is over, [>= D,
        B-1, K]. None: every draft is a point mass (an argmax), which the sampled tokens verify
        as they are."""
        return None

    def accept(
        self,
        drafts: torch.Tensor | None,
        tokens: torch.Tensor,
        step: StepShape,
        widths: torch.Tensor,
    ) -> torch.Tensor:
        """On the device: the drafts each decoding request accepts, given the target's tokens
        (request r's W_r = widths[r] of them after the requests before it; widths [D] is the
        step's own, on the device)."""
        return tokens.new_zeros(step.num_decoding)

    def commit(
        self, slots: torch.Tensor, accepted: torch.Tensor, step: StepShape, widths: torch.Tensor
    ) -> None:
        """After the step's commit into the device state: `slots` [D] decoding requests',
        `widths` [D] their rows."""

    def learn(self, step: StepShape, accepted: list[int], seconds: float) -> None:
        """A step read back: its acceptance and, on a GPU, its period."""

    def aborted(self) -> None:
        """The engine dropped its requests: the next step follows none."""

    def capture_graphs(self, max_batch_size: int, pool: Any) -> None:
        """Capture its own CUDA graphs (after the runner's)."""

    def info(self) -> dict[str, Any]:
        """Its figures for stats.json."""
        return {"verify_width_steps": None}

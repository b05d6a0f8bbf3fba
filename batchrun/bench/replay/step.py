"""A replayed step as the speculator reads it (spec_decode/base.py's StepShape) and a cost model
prices it: from its rows (requests, query rows, K/V tokens read, drafting requests, prefill
tokens), so that a model priced this way carries over to steps whose rows verify at different
widths."""

from __future__ import annotations

from dataclasses import dataclass

BLOCK = 16  # the DFlash block of the replayed drafter


@dataclass(frozen=True)
class ReplayStep:
    widths: tuple[int, ...]  # each decoding request's verify width
    decode_slots: tuple[int, ...]  # and its slot
    num_live: int
    prefill_rows: int
    context: int  # tokens of K/V the decoding requests read
    writes_context: bool
    constrained: bool
    drafter: bool = True  # a speculator with a draft (False: plain decoding)
    oracle: bool = False  # the benchmark's acceptance oracle replaces the drafts
    # The CUDA graphs it runs in (graphs.py): the target's padded rows (0: eager, its own
    # rows) and the draft's padded requests (0: what it drafts).
    target_graph_rows: int = 0
    draft_graph_requests: int = 0
    switched: bool = False  # it and the step before decode, their widest rows differ

    @property
    def num_requests(self) -> int:
        return self.num_live

    @property
    def num_decoding(self) -> int:
        return len(self.widths)

    @property
    def max_width(self) -> int:
        return max(self.widths, default=1)

    @property
    def width(self) -> int:
        """The step's widest row: the width the engine's step times are keyed by."""
        return self.max_width

    @property
    def decode_rows(self) -> int:
        return self.query_rows

    @property
    def num_rows(self) -> int:
        return self.query_rows + self.prefill_rows

    @property
    def target_rows(self) -> int:
        """Rows the target's forward runs: a graph's padded ones, or the step's own."""
        return self.target_graph_rows or self.num_rows

    @property
    def draft_requests(self) -> int:
        """Requests the draft's forward runs: its graph's padded ones, or those it drafts."""
        return self.draft_graph_requests or self.drafting

    @property
    def query_rows(self) -> int:
        """Rows the decoding requests verify: the sum of their widths."""
        return sum(self.widths)

    @property
    def drafting(self) -> int:
        """Requests the drafter proposes a block for: those verifying above width 1 (a row at
        width 1 decodes beside them undrafted)."""
        return sum(w > 1 for w in self.widths)

    @property
    def drafting_context(self) -> int:
        """Tokens of K/V the drafting requests read (the step's context split by its rows'
        share: the replay's requests of a step run at about one length)."""
        return self.context * self.drafting // max(self.num_decoding, 1)

    @property
    def context_writes(self) -> int:
        """Decoding requests whose new token the drafter writes into its context in a step
        that drafts nothing, while the speculator keeps its context. A width-1 row beside
        drafting ones has its context written in that step too, priced in the drafter's
        per-step part (context_ms_per_request is fitted on width-1 steps, whose graphs capture
        the features that a drafting step captures anyway)."""
        writes = self.drafter and self.writes_context and self.max_width == 1
        return self.num_decoding if writes else 0

    @property
    def draft_prefill_rows(self) -> int:
        """Prompt tokens whose context the drafter writes (every prefill row, with a draft)."""
        return self.prefill_rows if self.drafter else 0

    @property
    def kind(self) -> str:
        """The engine's step kind (engine/step_inputs.py's plan.kind)."""
        return "decode" if self.uniform else "mixed" if self.num_decoding else "prefill"

    @property
    def uniform(self) -> bool:
        return self.num_decoding == self.num_live

    @property
    def max_kv(self) -> int:
        return 0

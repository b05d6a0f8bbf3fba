"""A constrained row's grammar, and where in its output the grammar holds.

Without a reasoning parser the grammar holds from the first output token. With one (a
`reasoning_parser` job: SamplingParams.reasoning), it holds on the answer only, as vLLM's
structured outputs do with a reasoning parser: a think block, opened by the prompt's template or
by `<think>` as the first output token, is free text, and the matcher starts, fed nothing, at the
token after its `</think>` (or after the end a thinking budget forced). The answer holds no think
token, so the reasoning split's answer is what the grammar accepted, and no later block opens.

Masks along a verify round's drafts (grammar_masks.py) walk the same states: rows inside the
block are left unmasked, and a draft `</think>` starts the grammar for the rows after it, all
inside one round.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from batchrun.models.tokenizer import think_opened


class Phase(enum.Enum):
    MAY_THINK = "may_think"  # the first output token: the grammar's, or <think> opening a block
    THINKING = "thinking"  # inside the block: every token allowed
    ANSWER = "answer"  # the grammar holds


@dataclass(eq=False)
class RowGrammar:
    matcher: Any  # xgrammar's, at the committed answer
    think: tuple[int, int] | None = None  # <think>, </think>: the grammar waits for the answer
    phase: Phase = Phase.ANSWER

    @classmethod
    def of(cls, matcher: Any, think: tuple[int, int] | None, prompt: list[int]) -> RowGrammar:
        """A row's grammar at the start of its output; think: the think token ids when the row
        may think first (None: the grammar holds from the first token)."""
        if think is None:
            return cls(matcher)
        return cls(
            matcher, think, Phase.THINKING if think_opened(prompt, think) else Phase.MAY_THINK
        )

    def commit(self, tokens: Sequence[int], forced_end: int = 0) -> None:
        """The tokens the row committed; forced_end: how many of the last are a think block's
        end that the host forced (its budget ran out): the grammar starts after them."""
        phase = self.phase
        for token in tokens[: len(tokens) - forced_end]:
            phase = self._after(phase, token) or phase  # a sampled token is one the mask allowed
        self.phase = Phase.ANSWER if forced_end else phase

    def fill_masks(self, bits: torch.Tensor, first: int, rows: int, drafts: Sequence[int]) -> None:
        """Rows first .. first+rows-1 of `bits`: row j's mask after drafts[:j]. The matcher is
        walked along the drafts and taken back after, so it stays at the committed output. A
        draft the grammar forbids ends the walk: the target's token at the row before it is
        drawn from the masked logits, so it cannot equal that draft and acceptance stops there;
        the rows after it (or after a drafted end of sequence) are never committed and keep
        every token allowed."""
        phase, fed = self.phase, 0
        for j in range(rows):
            if j:
                after = self._after(phase, drafts[j - 1])
                if after is None:
                    break
                fed += after is Phase.ANSWER and phase is not Phase.THINKING
                phase = after
                if self.matcher.is_terminated():
                    break  # a drafted end of sequence: no row after it is committed
            self._fill(phase, bits, first + j)
        if fed:
            self.matcher.rollback(fed)

    def _after(self, phase: Phase, token: int) -> Phase | None:
        """The phase after `token`, fed to the matcher in the answer; None: forbidden there
        (the matcher then stays where it was)."""
        if self.think is not None:
            start, end = self.think
            if phase is Phase.THINKING:
                return Phase.ANSWER if token == end else Phase.THINKING
            if phase is Phase.MAY_THINK and token == start:
                return Phase.THINKING
            if token in self.think:
                return None
        return Phase.ANSWER if self.matcher.accept_token(token) else None

    def _fill(self, phase: Phase, bits: torch.Tensor, row: int) -> None:
        if phase is Phase.THINKING:
            return  # no mask: the bitmask starts with every token allowed
        self.matcher.fill_next_token_bitmask(bits, row)
        if self.think is not None:
            start, end = self.think
            _set_bit(bits, row, start, phase is Phase.MAY_THINK)
            _set_bit(bits, row, end, False)


def _set_bit(bits: torch.Tensor, row: int, token: int, allowed: bool) -> None:
    """Allow or forbid one token in an int32 bitmask row (bit t % 32 of word t // 32)."""
    word, bit = divmod(token, 32)
    value = int(bits[row, word]) & 0xFFFFFFFF
    value = value | (1 << bit) if allowed else value & ~(1 << bit)
    bits[row, word] = value - (1 << 32) if value >= 1 << 31 else value

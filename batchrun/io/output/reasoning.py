"""The reasoning split (`reasoning_parser`): a Qwen3 completion's think block apart from its
answer. Qwen3 writes `<think>` reasoning `</think>` then the answer; a template that opens the
block in the prompt (thinking-only models) leaves only `</think>` in the output. Output:
`reasoning` (the text inside the block, null when there is none), `completion` (the answer after
it; null when the row ended inside the block, cut by length or a stop), `reasoning_tokens`.
`completion_token_ids` stays whole. The split is by token ids, so a tokenizer that skips the
think tokens when decoding splits alike."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchrun.engine.core.requests import Request
from batchrun.engine.core.stopping import cut_at_stops, text_ids
from batchrun.errors import JobError
from batchrun.models.tokenizer import THINK_END, THINK_START, think_opened, think_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


REASONING_PARSERS = ("qwen3", "auto")  # auto: qwen3 where the tokenizer has the think tokens


class ReasoningSplit:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, parser: str) -> None:
        """Refuses `qwen3` for a tokenizer without single think tokens; `auto` then splits
        nothing (every row's reasoning null, its completion whole)."""
        self.tokenizer = tokenizer
        self.special = frozenset(tokenizer.all_special_ids)  # end-of-sequence tokens among them
        ids = think_token_ids(tokenizer)
        self.start, self.end = ids if ids is not None else (-1, -1)  # -1: no token is
        self.active = ids is not None
        if parser == "qwen3" and not self.active:
            raise JobError(
                f"reasoning_parser qwen3 needs {THINK_START} and {THINK_END} as single tokens "
                "of the target's tokenizer; it has not"
            )

    def split(self, request: Request) -> tuple[str | None, str | None, int]:
        """(reasoning, completion, reasoning_tokens) of a finished request."""
        if not self.active:
            return None, request.output.completion, 0
        ids = text_ids(request, {*request.params.stop_token_ids, *self.special})
        thinking = think_opened(request.prompt_ids, (self.start, self.end))
        if not thinking and ids and ids[0] == self.start:
            ids, thinking = ids[1:], True
        if not thinking:
            return None, request.output.completion, 0
        if self.end not in ids:  # ended inside the block: no answer
            return self._text(ids).strip(), None, len(ids)
        cut = ids.index(self.end)
        answer = cut_at_stops(self._text(ids[cut + 1 :]).lstrip(), request.params.stop)
        return self._text(ids[:cut]).strip(), answer, cut

    def _text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


def reasoning_split(
    parser: str | None, tokenizer: PreTrainedTokenizerBase
) -> ReasoningSplit | None:
    """The split the job's reasoning_parser asks for (None: none). Raises JobError as
    ReasoningSplit does."""
    return ReasoningSplit(tokenizer, parser) if parser is not None else None

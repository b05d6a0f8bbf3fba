"""Commit sampled tokens to a request, cutting at the first stop condition, and decode text.

Stop strings are searched incrementally (stop_scan.py); the completion is decoded once, when the
request finishes: its ids with special tokens skipped, cut at the first stop string."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from batchrun.engine.core.requests import Request
from batchrun.engine.core.stop_scan import StopScan
from batchrun.models.tokenizer import THINK_END, think_opened, think_token_ids


def skipped_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Special ids that decoding with skip_special_tokens drops (each one checked)."""
    special = set(tokenizer.all_special_ids)
    special |= {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return frozenset(i for i in special if tokenizer.decode([i], skip_special_tokens=True) == "")


class Stopper:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase | None, eos_ids: set[int], max_model_len: int
    ) -> None:
        """Without a tokenizer (engines built for benchmarks) there is no text: no stop strings
        and no completion."""
        self.tokenizer, self.eos_ids, self.max_model_len = tokenizer, eos_ids, max_model_len
        self.skipped = skipped_ids(tokenizer) if tokenizer is not None else frozenset()
        self.think = think_token_ids(tokenizer) if tokenizer is not None else None
        # What ends a think block that ran out of budget: Qwen3's own way of closing one.
        self.think_end: list[int] = []
        if self.think is not None and tokenizer is not None:
            self.think_end = tokenizer.encode(f"\n{THINK_END}\n\n", add_special_tokens=False)

    def commit(self, req: Request, tokens: list[int]) -> int:
        """Append tokens in order until one finishes the request; returns how many were kept.
        Tokens after the cut are dropped: they are neither output nor counted. A think block
        that spends its budget gets its end appended, and the output is marked `forced`."""
        out = req.output
        for n, token in enumerate(tokens, start=1):
            self._append(req, token)
            if not out.finish_reason and self._thought_enough(req, token):
                for forced in self.think_end:  # the target's own, as if it had sampled them
                    if not out.finish_reason:
                        self._append(req, forced)
                out.forced = not out.finish_reason  # the in-flight rounds sampled without them
            if out.finish_reason or out.forced:
                if out.finish_reason:
                    out.completion = self.decode(req)
                return n
        return len(tokens)

    def _append(self, req: Request, token: int) -> None:
        p, out = req.params, req.output
        out.token_ids.append(token)
        eos = token in self.eos_ids and not p.ignore_eos
        stops = eos or token in p.stop_token_ids or self._stop_string(req, token)
        if stops and len(out.token_ids) >= p.min_tokens:  # before min_tokens nothing stops
            out.finish_reason = "stop"
        elif len(out.token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            out.finish_reason = "length"

    def _thought_enough(self, req: Request, token: int) -> bool:
        """Whether the request's think block has spent its budget with this token (counts
        the tokens inside an open block: opened by the prompt's template or the output)."""
        budget = req.params.max_thinking_tokens
        if budget is None or self.think is None:
            return False
        start, end = self.think
        out = req.output
        if out.thinking is None and len(out.token_ids) == 1:
            out.thinking = 0 if think_opened(req.prompt_ids, self.think) else None
        if token == start:
            out.thinking = 0
        elif token == end:
            out.thinking = None
        elif out.thinking is not None:
            out.thinking += 1
        if out.thinking is not None and out.thinking >= budget:
            out.thinking = None
            return True
        return False

    def _stop_string(self, req: Request, token: int) -> bool:
        if not req.params.stop or token in self.skipped:
            return False
        out = req.output
        if out.stop_scan is None:
            out.stop_scan = StopScan(req.params.stop)
        return out.stop_scan.push(token, self._decode)

    def _decode(self, ids: list[int]) -> str:
        assert self.tokenizer is not None, "stop strings need a tokenizer"
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def decode(self, req: Request) -> str | None:
        if self.tokenizer is None:
            return None
        ids = text_ids(req, {*self.eos_ids, *req.params.stop_token_ids})
        text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
        return cut_at_stops(text, req.params.stop)


def text_ids(req: Request, stop_ids: set[int]) -> list[int]:
    """A finished request's output ids that are text: a stop token among `stop_ids` ends the
    text without being part of it."""
    ids = req.output.token_ids
    if req.output.finish_reason == "stop" and ids and ids[-1] in stop_ids:
        return ids[:-1]
    return ids


def cut_at_stops(text: str, stops: tuple[str, ...]) -> str:
    """The text up to the first stop string in it."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(cuts)] if cuts else text

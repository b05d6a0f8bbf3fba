"""Commit sampled tokens to a request, cutting at the first stop condition, and decode text."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from batchrun.engine.request import Request


class Stopper:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, eos_ids: set[int], max_model_len: int
    ) -> None:
        self.tokenizer, self.eos_ids, self.max_model_len = tokenizer, eos_ids, max_model_len

    def commit(self, req: Request, tokens: list[int]) -> int:
        """Append tokens in order until one finishes the request; returns how many were kept.
        Tokens after the cut are dropped: they are neither output nor counted."""
        p = req.params
        for n, token in enumerate(tokens, start=1):
            req.output_ids.append(token)
            if token in self.eos_ids or token in p.stop_token_ids or self._stop_string(req):
                req.finish_reason = "stop"
            elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                req.finish_reason = "length"
            if req.finish_reason:
                req.completion = self.decode(req)
                return n
        return len(tokens)

    def _stop_string(self, req: Request) -> bool:
        stops = req.params.stop
        if not stops:
            return False
        # The newest token can only complete a stop string that ends in it: decode a tail wide
        # enough to hold the longest one even when tokens are single bytes.
        window = 4 * max(len(s) for s in stops) + 4
        tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    def decode(self, req: Request) -> str:
        ids = req.output_ids
        last = ids[-1] if ids else None
        if last is not None and (last in self.eos_ids or last in req.params.stop_token_ids):
            ids = ids[:-1]  # a stop token ends the text without being part of it
        text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
        cuts = [i for i in (text.find(s) for s in req.params.stop) if i >= 0]
        return text[: min(cuts)] if cuts else text

"""Finds stop strings in a request's output text as tokens arrive, decoding only the newest ones.

The text is decoded incrementally, as vLLM's detokenize_incrementally does: `window` holds the
output ids from a prefix offset on, `read` marks where the ids not yet turned into text begin,
and the new text is decode(window)[len(decode(window[:read])):], the earlier ids serving as
context (a tokenizer may render a token differently after others). New text that ends in an
incomplete UTF-8 sequence ("\\ufffd") is searched but not taken, so the next token completes it.
Ids the tokenizer skips when decoding (special tokens) never enter the window, so any number of
them between the parts of a stop string changes nothing. Each token costs at most two decodes of
a few ids, and the search looks at the new text plus the (longest stop - 1) characters before it.
"""

from __future__ import annotations

from collections.abc import Callable

Decode = Callable[[list[int]], str]

# Ids held back at most while their text ends in an incomplete character; past this the text is
# taken as it is (a run of stray UTF-8 bytes), so a window never grows without bound.
MAX_PENDING = 16


class StopScan:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.keep = max(len(s) for s in stops) - 1  # characters of old text a stop may start in
        self.window: list[int] = []
        self.read = 0
        self.prefix_text = ""  # decode(window[:read])
        self.tail = ""  # the last `keep` characters of the text taken so far

    def push(self, token: int, decode: Decode) -> bool:
        """Adds one (not skipped) output id; True when a stop string ends in the new text."""
        self.window.append(token)
        text = decode(self.window)
        fresh = text[len(self.prefix_text) :]
        pending = text.endswith("\ufffd") or len(text) <= len(self.prefix_text)
        haystack = self.tail + (fresh.rstrip("\ufffd") if pending else fresh)
        found = any(s in haystack for s in self.stops)
        if not pending or len(self.window) - self.read > MAX_PENDING:
            taken = self.tail + fresh
            self.tail = taken[max(0, len(taken) - self.keep) :]
            self.window = self.window[self.read :]
            self.read = len(self.window)
            self.prefix_text = decode(self.window)
        return found

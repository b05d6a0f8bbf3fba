"""A one-line progress bar on stderr (rows done of total, output tokens/s, tau with a draft) and
the error rows logged above it."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

_WIDTH = 24
_REFRESH_SECONDS = 0.2


class ProgressBar:
    """Draws only on a terminal; `log` prints a line either way without tearing the bar."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total = total
        self.enabled = enabled and self.stream.isatty()
        self.started = time.monotonic()
        self._last_draw = 0.0
        self._line = ""

    def update(self, done: int, tokens: int, tau: float | None, force: bool = False) -> None:
        """done: rows with output; tokens: generated this run; tau: None without a draft."""
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last_draw < _REFRESH_SECONDS):
            return
        self._last_draw = now
        fraction = done / self.total if self.total else 1.0
        filled = int(fraction * _WIDTH)
        rate = tokens / max(now - self.started, 1e-9)
        line = (
            f"[{'#' * filled}{'.' * (_WIDTH - filled)}] {done}/{self.total} rows  {rate:,.0f} tok/s"
        )
        if tau is not None:
            line += f"  tau {tau:.2f}"
        self._draw(line)

    def log(self, message: str) -> None:
        if self.enabled:
            self.stream.write("\r\x1b[2K")
        self.stream.write(message + "\n")
        if self.enabled and self._line:
            self.stream.write(self._line)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._line:
            self.stream.write("\n")
            self.stream.flush()
        self._line = ""

    def _draw(self, line: str) -> None:
        self._line = line
        self.stream.write("\r\x1b[2K" + line)
        self.stream.flush()


MAX_LOGGED_ERRORS = 10


class ErrorLog:
    """Error rows on the progress bar's log: the first MAX_LOGGED_ERRORS, then one line saying
    more follow (nothing when quiet)."""

    def __init__(self, bar: ProgressBar, quiet: bool, id_column: str | None) -> None:
        self.bar, self.quiet, self.id_column = bar, quiet, id_column
        self.count = 0

    def log(self, row_index: int, values: dict[str, Any], message: str) -> None:
        if self.quiet:
            return
        self.count += 1
        if self.count > MAX_LOGGED_ERRORS + 1:
            return
        if self.count > MAX_LOGGED_ERRORS:
            self.bar.log("batchrun: more error rows follow; see the output's error column")
            return
        name = f" ({self.id_column}={values[self.id_column]!r})" if self.id_column else ""
        self.bar.log(f"batchrun: row {row_index}{name}: {message}")

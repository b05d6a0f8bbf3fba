"""Regular expressions as xgrammar reads them, and JSON Schema's `pattern` as ECMA-262 reads
it, turned into Python `re` patterns that match the same strings, so that a finished row can be
checked without xgrammar.

Where the dialects differ from Python's `re` (found by walking xgrammar's matcher over strings):
`\\d` and `\\w` (and `\\D`, `\\W`) are ASCII classes (`re.ASCII`); `\\s` is ECMA-262's
whitespace (U+00A0, U+FEFF and the Unicode spaces, not U+001C..U+001F), written out; `\\e` and
`\\cX` become the control characters; `(?<name>` is Python's `(?P<name>`; and `.` matches any
character in xgrammar's dialect (a `regex` constraint: `re.DOTALL`), any but a line terminator in
ECMA-262's (a `pattern`). One difference is left: `\\S` inside a character class is Python's
ASCII one, a little wider than xgrammar's (it also takes U+00A0 and the Unicode spaces), so
`[^\\S]` is narrower.
"""

from __future__ import annotations

import functools
import re
import warnings

from batchrun.sampling.xgrammar_warnings import xgrammar_warnings

_SPACE = r"\t\n\x0b\x0c\r \xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
_LINE_ENDS = r"\n\r\u2028\u2029"


@functools.lru_cache(maxsize=256)
def python_regex(pattern: str, *, dot_all: bool) -> re.Pattern[str]:
    """The Python pattern for `pattern`; dot_all: `.` matches any character (xgrammar's
    dialect), else any but a line terminator (ECMA-262's). re.error when Python cannot read it."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            escape = pattern[i + 1]
            if escape == "s":
                out.append(_SPACE if in_class else f"[{_SPACE}]")
            elif escape == "S" and not in_class:
                out.append(f"[^{_SPACE}]")
            elif escape == "e":
                out.append(r"\x1b")
            elif escape == "c" and pattern[i + 2 : i + 3].isalpha():
                out.append(f"\\x{ord(pattern[i + 2]) % 32:02x}")  # \cJ: control-J
                i += 1
            else:
                out.append(pattern[i : i + 2])
            i += 2
            continue
        if in_class:
            in_class = char != "]"  # xgrammar refuses an empty class: a ']' closes one
        elif char == "[":
            in_class = True
            if pattern.startswith("[^", i):  # the '^' is the class's, not an anchor
                out.append("[^")
                i += 2
                continue
        elif char == "." and not dot_all:
            out.append(f"[^{_LINE_ENDS}]")
            i += 1
            continue
        elif pattern.startswith("(?<", i) and pattern[i + 3 : i + 4] not in ("=", "!"):
            out.append("(?P<")  # a named group; (?<= and (?<! are lookbehinds
            i += 3
            continue
        out.append(char)
        i += 1
    flags = re.ASCII | (re.DOTALL if dot_all else 0)
    with warnings.catch_warnings():  # "possible nested set": '[' in a class is a literal here
        warnings.simplefilter("ignore", FutureWarning)
        return re.compile("".join(out), flags)


@functools.lru_cache(maxsize=128)
def regex_problem(pattern: str) -> str | None:
    """Why a regex constraint cannot be held to, or None: it can, or it does not compile
    (compiling says why). Refused: a regex xgrammar warns it will partly ignore, and one Python
    cannot read once converted (its finished rows could not be checked)."""
    import xgrammar

    with xgrammar_warnings() as warnings:
        try:
            xgrammar.Grammar.from_regex(pattern)
        except RuntimeError:
            return None
    if warnings:
        return f"regex is not supported: {warnings[0]}"
    try:
        python_regex(pattern, dot_all=True)
    except re.error as exc:
        return f"regex is not supported: Python's re cannot read it to check rows ({exc})"
    return None

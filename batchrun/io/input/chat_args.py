"""The chat template arguments a job or a row may not set: the names batchrun's call to
apply_chat_template already takes. Read from transformers' own signatures, so a name a new
transformers adds is refused too rather than failing every row."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

# How the renderer hands the template its conversation (render(messages=...)), beside the
# parameters of the functions on the way.
_TEMPLATE_CONVERSATION = "messages"


@functools.cache
def taken_names() -> frozenset[str]:
    """apply_chat_template's parameters, those of the renderer it passes the rest to, and the
    conversation's name in the template."""
    from transformers import PreTrainedTokenizerBase
    from transformers.utils.chat_template_utils import render_jinja_template

    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = {_TEMPLATE_CONVERSATION}
    for function in (PreTrainedTokenizerBase.apply_chat_template, render_jinja_template):
        parameters = inspect.signature(function).parameters.values()
        names |= {p.name for p in parameters if p.kind in named}
    return frozenset(names - {"self"})


def chat_kwargs_problem(kwargs: Mapping[str, Any]) -> str | None:
    """Why these chat template arguments cannot be used (None: they can)."""
    taken = sorted(set(kwargs) & taken_names()) if kwargs else []
    if taken:
        return f"{taken[0]!r} is set by batchrun, not by the template's arguments"
    return None

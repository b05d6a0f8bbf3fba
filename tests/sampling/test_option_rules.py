"""A declared option's rule is said and checked from its kind and range alone: the words of
the messages SamplingParams.problem() gives, for each shape of range."""

from __future__ import annotations

import pytest

from batchrun.sampling.option import Kind, Option
from batchrun.sampling.option_rules import interval, requirement, rule_problem


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (Option(Kind.INT, "", low=1), "an integer >= 1"),
        (Option(Kind.INT, "", low=0, note="(0 = off)"), "an integer >= 0 (0 = off)"),
        (Option(Kind.INT, "", low=1, high=1024), "an integer in [1, 1024]"),
        (Option(Kind.INT, "", low=-(1 << 63), high=(1 << 64) - 1), "an integer in [-2^63, 2^64)"),
        (Option(Kind.INT, "", low=0, at_most="max_tokens"), "an integer in [0, max_tokens]"),
        (Option(Kind.FLOAT, "", low=0), "a finite number >= 0"),
        (Option(Kind.FLOAT, "", low=0, low_open=True), "a finite number > 0"),
        (Option(Kind.FLOAT, "", low=-2, high=2), "a number in [-2, 2]"),
        (Option(Kind.FLOAT, "", low=0, low_open=True, high=1), "in (0, 1]"),
        (Option(Kind.FLOAT, "", low=0.5, high=1.5), "a number in [0.5, 1.5]"),
    ],
)
def test_a_range_reads_as_the_messages_say_it(spec: Option, words: str) -> None:
    assert requirement(spec) == words


def test_an_integer_range_bounded_by_another_option() -> None:
    spec = Option(Kind.INT, "", low=0, at_most="max_tokens")
    assert rule_problem("min_tokens", spec, 3, bound=3) is None
    assert rule_problem("min_tokens", spec, 4, bound=3) == (
        "min_tokens must be an integer in [0, max_tokens], got 4"
    )


def test_unset_is_allowed_only_where_declared() -> None:
    assert rule_problem("budget", Option(Kind.INT, "", low=0, unset="no limit"), None) is None
    assert rule_problem("n", Option(Kind.INT, "", low=1), None) == (
        "n must be an integer >= 1, got None"
    )


def test_a_number_rule_holds_for_the_float32_value_and_refuses_bools() -> None:
    spec = Option(Kind.FLOAT, "", low=0)
    assert (
        rule_problem("t", spec, 1e39)
        == "t must be a finite number >= 0, got 1e+39 (inf in float32)"
    )
    assert rule_problem("t", spec, True) == "t must be a finite number >= 0, got True"
    assert rule_problem("t", spec, float("nan")) is not None
    assert interval(Option(Kind.TOKEN_BIAS, "", low=-100, high=100)) == "[-100, 100]"

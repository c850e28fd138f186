"""Assertions pass on the right elements and fail saying what is missing and what is extra."""

from __future__ import annotations

import pytest

from onceflow.kernel.windows import Pane
from onceflow.testing import assert_that, equal_to, is_empty

PANES = [
    ("a", Pane(3, 0, 60_000, "early", 0, False)),
    ("a", Pane(5, 0, 60_000, "on_time", 1, True)),
    ("b", Pane(7, 0, 60_000, "on_time", 0, True)),
    ("a", Pane(1, 60_000, 120_000, "on_time", 0, False)),
]


def test_contains_exactly_ignores_order_but_counts_repeats():
    assert_that([("a", 1), {"x": [1]}, ("a", 1)]).contains_exactly([{"x": [1]}, ("a", 1), ("a", 1)])
    assert_that([1, 2], equal_to([2, 1]))
    assert_that([], is_empty())


def test_contains_exactly_names_missing_and_unexpected_with_counts():
    with pytest.raises(AssertionError) as err:
        assert_that([("a", 1), ("b", 3), ("b", 3)], label="totals").contains_exactly(
            [("a", 1), ("b", 2)]
        )
    text = str(err.value)
    assert "totals: contains_exactly failed" in text
    assert "missing (1, expected but not found): [('b', 2)]" in text
    assert "unexpected (2, found but not expected): [('b', 3) x2]" in text
    assert "got 3 element(s)" in text


def test_equal_to_fails_like_contains_exactly():
    with pytest.raises(AssertionError, match=r"missing \(1, expected but not found\): \[3\]"):
        assert_that([1, 2], equal_to([1, 2, 3]))


def test_contains_in_order_says_when_only_the_order_is_wrong():
    assert_that([1, 2, 3]).contains_in_order([1, 2, 3])
    with pytest.raises(AssertionError, match="the elements are right but their order is not"):
        assert_that([1, 2, 3]).contains_in_order([3, 2, 1])


def test_contains_allows_extra_elements_but_not_missing_ones():
    assert_that([1, 2, 3]).contains([3, 1])
    with pytest.raises(AssertionError, match=r"contains failed\n  missing .*\[4\]"):
        assert_that([1, 2, 3]).contains([4])


def test_is_empty_has_length_and_satisfies_show_the_offenders():
    with pytest.raises(AssertionError, match=r"expected no elements, got 1: \['x'\]"):
        assert_that(["x"]).is_empty()
    with pytest.raises(AssertionError, match="expected 3 elements, got 2"):
        assert_that([1, 2]).has_length(3)
    with pytest.raises(AssertionError, match=r"1 element\(s\) do not satisfy even: \[3\]"):
        assert_that([2, 4, 3]).satisfies(lambda n: n % 2 == 0, "even")


def test_narrowing_names_the_scope_in_messages():
    panes = assert_that(PANES, label="per-minute")
    panes.for_key("a").in_window(0, 60_000).has_timings(["early", "on_time"])
    panes.final().values().contains_exactly([("a", 5), ("b", 7)])
    panes.on_time().values().contains_exactly([("a", 5), ("b", 7), ("a", 1)])
    panes.early().has_length(1)
    panes.late().is_empty()
    with pytest.raises(AssertionError) as err:
        panes.for_key("b").final().values().contains_exactly([("b", 8)])
    assert "per-minute (key 'b', final panes, pane values): contains_exactly failed" in str(
        err.value
    )


def test_has_final_results_wants_every_closed_window_once_with_its_value():
    panes = assert_that(PANES, label="per-minute")
    panes.has_final_results({("a", 0, 60_000): 5, ("b", 0, 60_000): 7})
    with pytest.raises(AssertionError) as err:
        panes.has_final_results({("a", 0, 60_000): 6, ("b", 0, 60_000): 7})
    text = str(err.value)
    assert "missing (1, expected but not found): [(('a', 0, 60000), 6)]" in text
    assert "unexpected (1, found but not expected): [(('a', 0, 60000), 5)]" in text
    doubled = [*PANES, ("b", Pane(7, 0, 60_000, "late", 1, True))]
    with pytest.raises(AssertionError, match="windows with more than one final pane"):
        assert_that(doubled).has_final_results({("a", 0, 60_000): 5, ("b", 0, 60_000): 7})


def test_has_timings_shows_the_panes_it_got():
    with pytest.raises(
        AssertionError, match=r"expected panes \['on_time'\], got \['early', 'on_time'\]"
    ):
        assert_that(PANES).for_key("a").in_window(0, 60_000).has_timings(["on_time"])


def test_window_helpers_refuse_elements_that_are_not_panes():
    with pytest.raises(AssertionError, match=r"expected \(key, Pane\) elements .*\('a', 1\)"):
        assert_that([("a", 1)]).final()
    with pytest.raises(AssertionError, match=r"expected \(key, value\) pairs .*\[5\]"):
        assert_that([5]).for_key("a")


def test_where_and_map_narrow_and_project():
    letters = [{"stage": "parse", "code": "user_error"}, {"stage": "sum", "code": "window_closed"}]
    assert_that(letters).where(lambda d: d["stage"] == "sum").map(
        lambda d: d["code"]
    ).contains_exactly(["window_closed"])

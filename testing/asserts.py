"""Assertions on what a test run's sinks received, with messages that show the difference.

In the style of Beam's ``assert_that`` / ``PAssert``: wrap what a sink received and say what
it must hold; the order in which records reach a sink is not part of a pipeline's result,
so comparisons ignore it unless asked (:meth:`Assertion.contains_in_order`)::

    out = run_test(pipeline, {"orders": [...]})
    assert_that(out["revenue-out"]).contains_exactly([("c1", 15), ("c2", 7)])
    assert_that(out["revenue-out"], equal_to([("c1", 15), ("c2", 7)]))  # the same
    assert_that(out.dead_letters).map(lambda d: d["code"]).contains_exactly(["window_closed"])

Windowed combines send ``(key, Pane)``; narrow to some panes, then compare their values::

    panes = assert_that(out["per-minute"])
    panes.has_final_results({("c1", 0, 60_000): 15, ("c1", 60_000, 120_000): 4})
    panes.for_key("c1").in_window(0, 60_000).has_timings(["early", "on_time", "late"])
    panes.final().values().contains_exactly([("c1", 15), ("c1", 4)])

A failed assertion raises :class:`AssertionError` saying which elements are missing and
which were not expected, with their counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from onceflow.kernel.windows import Pane

MAX_SHOWN = 20
Matcher = Callable[[Sequence[Any]], None]


def assert_that(
    actual: Iterable[Any], matcher: Matcher | None = None, label: str = ""
) -> Assertion:
    """An :class:`Assertion` on ``actual``; with ``matcher`` (e.g. :func:`equal_to`), check it."""
    assertion = Assertion(list(actual), label)
    if matcher is not None:
        matcher(assertion.elements)
    return assertion


def equal_to(expected: Iterable[Any]) -> Matcher:
    """Matcher: the same elements as ``expected``, as many times each, in any order."""
    wanted = list(expected)

    def match(actual: Sequence[Any]) -> None:
        Assertion(list(actual)).contains_exactly(wanted)

    return match


def is_empty() -> Matcher:
    """Matcher: no element at all."""

    def match(actual: Sequence[Any]) -> None:
        Assertion(list(actual)).is_empty()

    return match


class Assertion:
    """What a sink received (or a narrowed part of it), and checks on it.

    Narrowing and mapping return a new :class:`Assertion`; checks return ``self`` so that
    they chain.
    """

    def __init__(self, elements: list[Any], label: str = "", scope: str = "") -> None:
        self.elements = elements
        self.label = label
        self.scope = scope

    # -- checks --------------------------------------------------------------------------

    def contains_exactly(self, expected: Iterable[Any]) -> Assertion:
        """The same elements as ``expected``, as many times each, in any order."""
        wanted = list(expected)
        missing, unexpected = _difference(wanted, self.elements)
        if missing or unexpected:
            self._fail("contains_exactly", wanted, missing, unexpected)
        return self

    def contains_in_order(self, expected: Iterable[Any]) -> Assertion:
        """Exactly ``expected``, in that order."""
        wanted = list(expected)
        if wanted != self.elements:
            missing, unexpected = _difference(wanted, self.elements)
            if not missing and not unexpected:
                lines = [
                    f"{self._what()}: the elements are right but their order is not",
                    f"  expected: {_show(wanted)}",
                    f"  got:      {_show(self.elements)}",
                ]
                raise AssertionError("\n".join(lines))
            self._fail("contains_in_order", wanted, missing, unexpected)
        return self

    def contains(self, expected: Iterable[Any]) -> Assertion:
        """At least the elements of ``expected`` (as many times each); others may be there."""
        wanted = list(expected)
        missing, _ = _difference(wanted, self.elements)
        if missing:
            self._fail("contains", wanted, missing, [])
        return self

    def is_empty(self) -> Assertion:
        """No element at all."""
        if self.elements:
            n = len(self.elements)
            msg = f"{self._what()}: expected no elements, got {n}: {_show(self.elements)}"
            raise AssertionError(msg)
        return self

    def has_length(self, n: int) -> Assertion:
        """Exactly ``n`` elements."""
        if len(self.elements) != n:
            got = len(self.elements)
            msg = f"{self._what()}: expected {n} elements, got {got}: {_show(self.elements)}"
            raise AssertionError(msg)
        return self

    def satisfies(self, predicate: Callable[[Any], bool], description: str = "") -> Assertion:
        """Every element satisfies ``predicate``."""
        bad = [e for e in self.elements if not predicate(e)]
        if bad:
            what = description or getattr(predicate, "__name__", "the predicate")
            msg = f"{self._what()}: {len(bad)} element(s) do not satisfy {what}: {_show(bad)}"
            raise AssertionError(msg)
        return self

    # -- narrowing -----------------------------------------------------------------------

    def where(self, predicate: Callable[[Any], bool], description: str = "") -> Assertion:
        """Only the elements for which ``predicate`` is true."""
        what = description or getattr(predicate, "__name__", "a predicate")
        return self._narrow([e for e in self.elements if predicate(e)], f"where {what}")

    def map(self, fn: Callable[[Any], Any]) -> Assertion:
        """Each element passed through ``fn`` (e.g. to compare one field)."""
        name = getattr(fn, "__name__", "fn")
        return self._narrow([fn(e) for e in self.elements], f"mapped by {name}")

    def for_key(self, key: Any) -> Assertion:
        """Elements ``(key, ...)`` of one key."""
        return self._narrow([e for e in self._pairs() if e[0] == key], f"key {key!r}")

    def in_window(self, start: int, end: int) -> Assertion:
        """Panes of the window ``[start, end)`` (ms), in pane order."""
        found = [e for e in self._panes() if e[1].start == start and e[1].end == end]
        found.sort(key=lambda e: e[1].index)
        return self._narrow(found, f"window [{start}, {end})")

    def final(self) -> Assertion:
        """Final panes only (one per closed window)."""
        return self._narrow([e for e in self._panes() if e[1].final], "final panes")

    def early(self) -> Assertion:
        """Early panes only."""
        return self._by_timing("early")

    def on_time(self) -> Assertion:
        """On-time panes only."""
        return self._by_timing("on_time")

    def late(self) -> Assertion:
        """Late panes only."""
        return self._by_timing("late")

    def values(self) -> Assertion:
        """``(key, Pane)`` elements as ``(key, pane value)``."""
        return self._narrow([(k, p.value) for k, p in self._panes()], "pane values")

    # -- windows -------------------------------------------------------------------------

    def has_final_results(self, expected: Mapping[tuple[Any, int, int], Any]) -> Assertion:
        """Exactly one final pane per window, with these values: ``{(key, start, end): v}``.

        Windows still open (no final pane) must not be in ``expected``.
        """
        finals: dict[tuple[Any, int, int], list[Any]] = {}
        for key, pane in self._panes():
            if pane.final:
                finals.setdefault((key, pane.start, pane.end), []).append(pane.value)
        twice = {w: v for w, v in finals.items() if len(v) > 1}
        if twice:
            msg = f"{self._what()}: windows with more than one final pane: {_show(twice)}"
            raise AssertionError(msg)
        got = {w: v[0] for w, v in finals.items()}
        missing, unexpected = _difference(sorted(expected.items(), key=repr), list(got.items()))
        if missing or unexpected:
            self._fail("has_final_results", list(expected.items()), missing, unexpected)
        return self

    def has_timings(self, expected: Sequence[str]) -> Assertion:
        """The panes' timings in pane order (narrow to one window first)."""
        panes = sorted(self._panes(), key=lambda e: (repr(e[0]), e[1].start, e[1].index))
        timings = [p.timing for _, p in panes]
        if timings != list(expected):
            msg = f"{self._what()}: expected panes {list(expected)}, got {timings}: {_show(panes)}"
            raise AssertionError(msg)
        return self

    # -- helpers -------------------------------------------------------------------------

    def _by_timing(self, timing: str) -> Assertion:
        return self._narrow([e for e in self._panes() if e[1].timing == timing], f"{timing} panes")

    def _narrow(self, elements: list[Any], scope: str) -> Assertion:
        return Assertion(elements, self.label, f"{self.scope}, {scope}" if self.scope else scope)

    def _pairs(self) -> list[tuple[Any, Any]]:
        bad = [e for e in self.elements if not (isinstance(e, tuple) and len(e) == 2)]
        if bad:
            msg = f"{self._what()}: expected (key, value) pairs (a keyed stream), got {_show(bad)}"
            raise AssertionError(msg)
        return list(self.elements)

    def _panes(self) -> list[tuple[Any, Pane]]:
        pairs = self._pairs()
        bad = [e for e in pairs if not isinstance(e[1], Pane)]
        if bad:
            msg = (
                f"{self._what()}: expected (key, Pane) elements (a windowed combine's output), "
                f"got {_show(bad)}"
            )
            raise AssertionError(msg)
        return pairs

    def _what(self) -> str:
        where = self.label or "elements"
        return f"{where} ({self.scope})" if self.scope else where

    def _fail(
        self, check: str, wanted: list[Any], missing: list[Any], unexpected: list[Any]
    ) -> None:
        lines = [f"{self._what()}: {check} failed"]
        if missing:
            lines.append(f"  missing ({len(missing)}, expected but not found): {_show(missing)}")
        if unexpected:
            lines.append(
                f"  unexpected ({len(unexpected)}, found but not expected): {_show(unexpected)}"
            )
        lines.append(f"  expected {len(wanted)} element(s): {_show(wanted)}")
        lines.append(f"  got {len(self.elements)} element(s): {_show(self.elements)}")
        raise AssertionError("\n".join(lines))


def _difference(expected: list[Any], actual: list[Any]) -> tuple[list[Any], list[Any]]:
    """Multiset difference by ``==`` (elements may be unhashable): (missing, unexpected)."""
    left = list(actual)
    missing = []
    for item in expected:
        for i, candidate in enumerate(left):
            if candidate == item:
                del left[i]
                break
        else:
            missing.append(item)
    return missing, left


def _show(items: Any) -> str:
    """A bounded, stable text of a list or dict (sorted by text, counted when repeated)."""
    if isinstance(items, dict):
        items = list(items.items())
    texts = sorted(repr(x) for x in items)
    counted: dict[str, int] = {}
    for t in texts:
        counted[t] = counted.get(t, 0) + 1
    shown = [f"{t} x{n}" if n > 1 else t for t, n in counted.items()]
    more = f", ... ({len(shown) - MAX_SHOWN} more)" if len(shown) > MAX_SHOWN else ""
    return "[" + ", ".join(shown[:MAX_SHOWN]) + more + "]"

"""Crashpoint names are declared once (``runtime.faults.CrashPoint``) and checked.

A test arms a crashpoint by name (``Crash("after_commit", ...)`` or an ``ONCEFLOW_CRASH``
value ``point=...``); a name the runtime never calls would make the test pass without ever
crashing. These tests read every test module and fail on a name that is not declared, and on
a declared name the runtime never calls.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from onceflow.runtime.faults import DRIVER_POINTS, POINTS, TASK_POINTS, CrashPoint

ROOT = Path(__file__).resolve().parents[2]
NAMED = (
    re.compile(r"\bCrash\(\s*(?:point\s*=\s*)?[\"'](\w+)[\"']"),
    re.compile(r"\bpoint=(\w+)"),
)


def named_points(text: str) -> set[str]:
    """Every crashpoint name a test's source arms."""
    return {m.group(1) for pattern in NAMED for m in pattern.finditer(text)}


def _used_in_tests() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path == Path(__file__).resolve():
            continue
        names = named_points(path.read_text())
        if names:
            found[str(path.relative_to(ROOT))] = names
    return found


def test_every_crashpoint_a_test_names_is_declared() -> None:
    used = _used_in_tests()
    assert sum(len(v) for v in used.values()) > 10, "the scan found no crashpoints: broken"
    unknown = sorted(f"{path}: {n}" for path, names in used.items() for n in names - set(POINTS))
    assert not unknown, f"tests arm crashpoints that are not declared: {sorted(unknown)}"


def test_the_scan_sees_an_unknown_name() -> None:
    text = 'Crash("after_comit", stage="count")\nenv = "point=batch_ending,batch=1"'
    assert named_points(text) - set(POINTS) == {"after_comit", "batch_ending"}


def test_every_declared_crashpoint_is_called_by_the_runtime() -> None:
    called: set[str] = set()
    for path in (ROOT / "runtime").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or not isinstance(node.value, ast.Name):
                continue
            if node.value.id == "CrashPoint":
                called.add(node.attr)
    assert called == {p.name for p in CrashPoint}
    assert TASK_POINTS | DRIVER_POINTS == set(CrashPoint)

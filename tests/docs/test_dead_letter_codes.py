"""Every dead-letter code Onceflow writes is in docs/guide/dead-letters.md's table, and only those.

The codes are read from the source: the ``code`` of every ``DeadLetter(...)`` built, the code
argument of the helpers that build one (``letter``, ``_refuse``, ``_letter``), and the
``dead_letter_code`` of exception classes (a join's late records, issue 42). A letter built
without a code would carry the default ``error``, which names nothing: it counts as a code
and fails the test until it gets one of its own.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runtime", "dedup", "connectors", "backup", "kernel", "pipeline", "testing")
# helper -> the position of its code argument
HELPERS = {"DeadLetter": 7, "letter": 3, "_refuse": 2, "_letter": 2}
ROW = re.compile(r"^\| `([a-z_]+)` \|", re.M)


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _code_of(call: ast.Call) -> str | None:
    at = HELPERS[_name(call.func)]
    for kw in call.keywords:
        if kw.arg == "code":
            return kw.value.value if isinstance(kw.value, ast.Constant) else "?"
    if len(call.args) > at:
        arg = call.args[at]
        return arg.value if isinstance(arg, ast.Constant) else None  # a variable: passed on
    return "error" if _name(call.func) == "DeadLetter" else None


def written_codes() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                code = None
                if isinstance(node, ast.Call) and _name(node.func) in HELPERS:
                    code = _code_of(node)
                elif isinstance(node, ast.Assign) and any(
                    getattr(t, "id", "") == "dead_letter_code" for t in node.targets
                ):
                    code = getattr(node.value, "value", "?")
                if code is not None:
                    found.setdefault(code, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_the_codes_written_are_the_codes_documented():
    written = written_codes()
    documented = set(ROW.findall((ROOT / "docs/guide/dead-letters.md").read_text()))
    written.setdefault("user_error", ["runtime/ops/record_text.py: USER_ERROR"])
    undocumented = {c: where for c, where in written.items() if c not in documented}
    assert undocumented == {}, "add these codes to the table of docs/guide/dead-letters.md"
    assert documented - set(written) == set(), "the table lists codes nothing writes"
    assert "late_for_join" in written

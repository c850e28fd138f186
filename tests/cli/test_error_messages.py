"""Every ``onceflow <command> --option`` a message suggests exists in the CLI (issue 29).

A message once told users to rerun with ``--namespace``, which ``onceflow run`` does not
have. The package's string literals (f-strings read with ``{}`` for their values, docstrings
left out) are searched for ``onceflow <command>`` and the options after it in the same
clause; those must be options of that command in the parser ``onceflow`` builds. An option
named alone must exist in some command, and in ``onceflow run`` when the message comes from
code that only runs inside a run.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from onceflow.cli.main import build_parser, commands_of

ROOT = Path(__file__).resolve().parents[2]
# The installed packages whose messages reach users (testing/ starts other programs).
PACKAGES = ("backup", "cli", "connectors", "dedup", "graph_optimizer", "kernel", "operations")
PACKAGES += ("pipeline", "runtime")
RUN_ONLY = ("backup", "connectors", "dedup", "runtime")  # code that runs inside a run
FOREIGN = {"--recursive"}  # options of other programs a message names (aws s3 rm)
COMMAND = re.compile(r"\bonceflow ([a-z][\w-]*)((?:[^.;,()\n]|\.(?!\s))*)")
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _literals(path: Path) -> list[tuple[int, str]]:
    """The string literals of a module that have words in them, but not its docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            skip.add(id(body[0].value))  # a docstring (or a bare string statement)
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)  # read whole, below
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if " " in text and "--" in text and not text.lstrip().startswith("<"):  # not a page
            out.append((node.lineno, text))
    return out


def _messages() -> list[tuple[str, str]]:
    found = []  # (where, text)
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, text in _literals(path):
                found.append((f"{path.relative_to(ROOT)}:{line}", text))
    return found


def _options(parser) -> set[str]:
    """A command's options, with those of its actions (``onceflow state get --key``)."""
    found = set()
    for action in parser._actions:  # noqa: SLF001
        found.update(action.option_strings)
        if isinstance(action.choices, dict):  # a command's actions (subparsers)
            for sub in action.choices.values():
                found |= _options(sub)
    return found


COMMANDS = {name: _options(p) for name, p in commands_of(build_parser()).items()}
MESSAGES = _messages()


def test_messages_were_found():
    assert len(MESSAGES) > 20
    assert any("onceflow reset --namespace" in text for _, text in MESSAGES)


@pytest.mark.parametrize(("where", "text"), MESSAGES, ids=[w for w, _ in MESSAGES])
def test_every_command_and_option_a_message_names_exists(where, text):
    shown = text[:300]
    for match in COMMAND.finditer(text):
        command, clause = match.groups()
        named = OPTION.findall(clause)
        if command not in COMMANDS:
            assert not named, f"{where}: there is no command 'onceflow {command}': {shown!r}"
            continue
        missing = [o for o in named if o not in COMMANDS[command]]
        assert not missing, f"{where}: onceflow {command} has no {missing}: {shown!r}"
    alone = set(OPTION.findall(COMMAND.sub("", text))) - FOREIGN
    known = COMMANDS["run"] if where.startswith(RUN_ONLY) else set().union(*COMMANDS.values())
    assert alone <= known, f"{where}: no such option {sorted(alone - known)}: {shown!r}"

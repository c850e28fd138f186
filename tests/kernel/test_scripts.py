"""The Lua scripts are package files, read through the package (as an installed wheel reads
them), and each one as composed is valid Lua that Redis loads; no Python module holds Lua."""

from __future__ import annotations

import ast
from importlib.resources import files
from pathlib import Path

import pytest

from onceflow.kernel import scripts

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("backup", "cli", "connectors", "dedup", "graph_optimizer", "kernel", "operations")
PACKAGES += ("pipeline", "runtime", "testing")


def test_every_lua_file_is_a_script_or_a_piece_one_uses():
    shipped = {p.name[:-4] for p in files("onceflow.kernel").joinpath("lua").iterdir()}
    used = set(scripts.SCRIPTS) | {part for parts in scripts.SCRIPTS.values() for part in parts}
    assert shipped == used


@pytest.mark.redis
@pytest.mark.parametrize("name", sorted(scripts.SCRIPTS))
def test_each_script_loads_in_redis(name, redis_server):
    client = redis_server.client()
    text = scripts.source(name)
    assert "@" not in text.replace("'@'", ""), "a placeholder was left unfilled"
    assert client.script_load(text)


def _string_literals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def test_no_module_holds_lua():
    holding = [
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if any("redis.call(" in text for text in _string_literals(path))
    ]
    assert holding == []

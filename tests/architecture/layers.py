"""The import graph of the ``onceflow`` package, read from the source, and its layer rules.

Layers, top to bottom; a module may import its own package and the layers below it, never
one above, and packages sharing a layer never import each other:

    onceflow (the import surface), onceflow.cli
    onceflow.testing
    onceflow.operations
    onceflow.pipeline
    onceflow.graph_optimizer
    onceflow.runtime
    onceflow.dedup | onceflow.connectors
    onceflow.backup
    onceflow.kernel

Every import counts, including those inside functions and ``TYPE_CHECKING`` blocks. Nothing
below the command line imports the root package ``onceflow`` itself (the import surface; the
demo pipelines of ``onceflow.cli`` are written as users write theirs), and no module imports
a name starting with ``_`` from another module.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYERS: tuple[tuple[str, ...], ...] = (
    ("onceflow.cli",),
    ("onceflow.testing",),
    ("onceflow.operations",),
    ("onceflow.pipeline",),
    ("onceflow.graph_optimizer",),
    ("onceflow.runtime",),
    ("onceflow.dedup", "onceflow.connectors"),
    ("onceflow.backup",),
    ("onceflow.kernel",),
)
# Rooms inside a package, and what each may never import (see runtime/__init__.py): the driver
# may import the task room, the task room the operators; a Spark task never reaches the
# driver's code, the operators reach neither the task loop nor the exactly-once machinery;
# neither the driver nor the task loop knows one connector (Kafka) by its modules.
_RT = "onceflow.runtime"
ROOMS: dict[str, tuple[str, ...]] = {
    # the driver and the task loop ask a source or sink through onceflow.connectors.base
    f"{_RT}.driver": ("onceflow.connectors.kafka",),
    f"{_RT}.task": (f"{_RT}.driver", "onceflow.connectors.kafka"),
    f"{_RT}.ops": (
        f"{_RT}.driver",
        f"{_RT}.task",
        f"{_RT}.spark_env",
        "onceflow.dedup",
        "onceflow.backup",
        "onceflow.connectors",
    ),
    f"{_RT}.spark_env": (f"{_RT}.driver", f"{_RT}.task", f"{_RT}.ops"),
    # what every room shares imports no room
    **{
        f"{_RT}.{shared}": (f"{_RT}.driver", f"{_RT}.task", f"{_RT}.ops", f"{_RT}.spark_env")
        for shared in ("spec", "guard", "errors", "faults", "metrics", "combine_fn", "user_state")
    },
}
SURFACE = ("onceflow", "onceflow.__main__")  # the root package: may import anything
SURFACE_USERS = ("onceflow.cli",)  # may import the root package, as users do


@dataclass(frozen=True)
class Edge:
    """``importer`` imports ``imported`` (``names`` taken from it) at ``where``."""

    importer: str
    imported: str
    names: tuple[str, ...]
    where: str


def modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name, from pyproject's mapping."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found: dict[str, Path] = {}
    for package, folder in config["tool"]["setuptools"]["package-dir"].items():
        base = ROOT / folder
        files = base.glob("*.py") if package == "onceflow" else base.rglob("*.py")
        for path in files:
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _absolute(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def edges() -> list[Edge]:
    """Every import of an ``onceflow`` module by an ``onceflow`` module."""
    out: list[Edge] = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "onceflow":
                        out.append(Edge(name, alias.name, (), where))
            elif isinstance(node, ast.ImportFrom):
                target = _absolute(name, is_package, node)
                if target.split(".")[0] == "onceflow":
                    names = tuple(a.name for a in node.names)
                    out.append(Edge(name, target, names, where))
    return out


def layer_of(module: str) -> int | None:
    """Index of the layer holding ``module`` (0 is the top), None for the surface."""
    for i, layer in enumerate(LAYERS):
        for package in layer:
            if module == package or module.startswith(package + "."):
                return i
    return None


def package_of(module: str) -> str | None:
    """The layered package holding ``module``."""
    for layer in LAYERS:
        for package in layer:
            if module == package or module.startswith(package + "."):
                return package
    return None


def violations(graph: list[Edge]) -> list[str]:
    """Every edge that breaks a rule, as one line saying which and where."""
    found: list[str] = []
    for e in graph:
        if e.importer in SURFACE:
            continue
        target = e.imported
        if target == "onceflow":
            subpackages = [n for n in e.names if layer_of(f"onceflow.{n}") is not None]
            user = any(e.importer.startswith(p) for p in SURFACE_USERS)
            if len(subpackages) < len(e.names) and not user:
                found.append(f"{e.where}: {e.importer} imports the root package 'onceflow'")
            target = f"onceflow.{subpackages[0]}" if subpackages else target
        mine, theirs = layer_of(e.importer), layer_of(target)
        if mine is None or theirs is None:
            continue
        if theirs < mine:
            found.append(f"{e.where}: {e.importer} (lower) imports {target} (higher layer)")
        elif theirs == mine and package_of(e.importer) != package_of(target):
            found.append(f"{e.where}: {e.importer} imports its sibling layer {target}")
        found += room_violations(e, target)
        private = [n for n in e.names if n.startswith("_") and n != "__version__"]
        if private and package_of(e.importer) is not None:
            found.append(f"{e.where}: {e.importer} imports private {private} from {target}")
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def room_violations(e: Edge, target: str) -> list[str]:
    """The edge's breaks of :data:`ROOMS` (a room importing what it may never import)."""
    found = []
    for room, never in ROOMS.items():
        if not _within(e.importer, room):
            continue
        for banned in never:
            hits = [target] if _within(target, banned) else []
            if target == banned.rpartition(".")[0]:  # from onceflow.runtime import task
                hits = [f"{target}.{n}" for n in e.names if _within(f"{target}.{n}", banned)]
            found += [f"{e.where}: {e.importer} (room {room}) imports {h}" for h in hits]
    return found


def cycles(graph: list[Edge]) -> list[list[str]]:
    """Import cycles between modules (module-level and deferred imports alike)."""
    known = set(modules())
    adjacency: dict[str, set[str]] = {m: set() for m in known}
    for e in graph:
        targets = [e.imported]
        if e.names:
            targets += [f"{e.imported}.{n}" for n in e.names]
        for t in targets:
            if t in known and t != e.importer and e.importer not in SURFACE:
                adjacency[e.importer].add(t)
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(adjacency[m]):
            if state.get(n) == 1:
                found.append([*stack[stack.index(n) :], n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(adjacency):
        if m not in state:
            visit(m)
    return found

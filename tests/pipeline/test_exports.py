"""``onceflow.sinks`` and ``onceflow.sources`` export every sink and source of ``connectors/``.

The connectors are found by walking the package and collecting every subclass of
:class:`SinkConnector` and :class:`SourceConnector` defined there: a new connector that is
not exported fails the test by name (issue 41: the PostgreSQL sink was importable only from
``onceflow.connectors.postgres``). A name exported but not built in ``connectors/`` fails too.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import onceflow.connectors
from onceflow.connectors.base import SinkConnector, SourceConnector


def _connector_classes(base: type) -> set[type]:
    """Every subclass of ``base`` (at any depth) defined in a module of ``onceflow.connectors``."""
    for module in pkgutil.walk_packages(onceflow.connectors.__path__, "onceflow.connectors."):
        importlib.import_module(module.name)
    found: set[type] = set()
    todo = [base]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("onceflow.connectors."):
                found.add(sub)
    return found


def _exported(package: str) -> dict[str, object]:
    module = importlib.import_module(package)
    return {name: getattr(module, name) for name in module.__all__}


@pytest.mark.parametrize(
    ("package", "base"),
    [("onceflow.sinks", SinkConnector), ("onceflow.sources", SourceConnector)],
)
def test_every_connector_is_exported(package, base):
    exported = _exported(package).values()
    missing = sorted(
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in _connector_classes(base)
        if cls not in exported
    )
    assert missing == [], f"export these from {package} (pipeline/{package.split('.')[1]}.py)"


@pytest.mark.parametrize("package", ["onceflow.sinks", "onceflow.sources"])
def test_every_export_is_a_connector_or_makes_one(package):
    # a factory (sources.TextFile, sources.Parquet) is a function of connectors/ that
    # returns a source; every class exported is a connector
    strays = [
        name
        for name, value in _exported(package).items()
        if not getattr(value, "__module__", "").startswith("onceflow.connectors.")
        or (isinstance(value, type) and not issubclass(value, (SinkConnector, SourceConnector)))
    ]
    assert strays == []

"""docs/reference/connectors.md documents every source and sink, under the name users import.

Each name ``onceflow.sources`` and ``onceflow.sinks`` export (every connector of
``connectors/``: tests/pipeline/test_exports.py) must have its ``::: module.Name`` block on
the page, headed by that name (``heading: Postgres``), or by its own name when ``onceflow``
exports it under that name (``KafkaSink`` is ``sinks.Kafka``).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import onceflow

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "connectors.md"
# ``::: path`` and the ``heading:`` of its options, if any
BLOCK = re.compile(r"^::: (\S+)\n((?:    .*\n)*)", re.M)
HEADING = re.compile(r"^ +heading: (\S+)$", re.M)


def _documented() -> dict[str, str]:
    """Each documented object's dotted path -> the heading it is shown under."""
    out = {}
    for path, options in BLOCK.findall(PAGE.read_text()):
        heading = HEADING.search(options)
        out[path] = heading.group(1) if heading else path.rsplit(".", 1)[1]
    return out


def _exports(package: str) -> list[tuple[str, object]]:
    module = importlib.import_module(package)
    return [(name, getattr(module, name)) for name in module.__all__]


@pytest.mark.parametrize(
    ("name", "value"),
    [pytest.param(n, v, id=f"sources.{n}") for n, v in _exports("onceflow.sources")]
    + [pytest.param(n, v, id=f"sinks.{n}") for n, v in _exports("onceflow.sinks")],
)
def test_every_source_and_sink_is_in_the_reference_under_its_name(name, value):
    path = f"{value.__module__}.{value.__qualname__}"
    documented = _documented()
    assert path in documented, f"add '::: {path}' to {PAGE.name} (with heading: {name})"
    own = value.__qualname__
    allowed = {name, own} if getattr(onceflow, own, None) is value else {name}
    assert documented[path] in allowed, f"show {path} under the heading {name}"

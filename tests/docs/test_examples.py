"""Every shipped example loads as ``onceflow explain`` loads it, under a name of its own.

A pipeline's name is its Redis namespace: two examples of one name share state, and the
second one run is refused (another plan holds the namespace). Issue 29.
"""

from __future__ import annotations

from pathlib import Path

from onceflow.cli.loader import load_pipeline

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))


def test_every_example_has_a_pipeline_name_of_its_own():
    names = {path.name: load_pipeline(str(path)).name for path in EXAMPLES}
    assert len(names) >= 4
    assert len(set(names.values())) == len(names), names

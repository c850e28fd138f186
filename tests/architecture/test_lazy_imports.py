"""The package imports its API on first use: Spark's planner interpreters stay light.

Spark starts a fresh interpreter for each planning step of the Kafka data source, and each
one imports :mod:`onceflow.connectors.kafka.datasource` (see ``onceflow/__init__.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys

# what a planner interpreter must not import along with the data source
HEAVY = ("onceflow.pipeline", "onceflow.runtime", "onceflow.dedup", "onceflow.connectors.files")


def _fresh(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return done.stdout


def test_the_kafka_data_source_imports_without_the_api() -> None:
    out = _fresh(
        "import json, sys\n"
        "import onceflow.connectors.kafka.datasource\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    loaded = json.loads(out)
    heavy = [m for m in loaded if m.startswith(HEAVY)]
    assert heavy == []


def test_every_exported_name_and_alias_resolves() -> None:
    out = _fresh(
        "import json\n"
        "import onceflow\n"
        "import onceflow.pipeline.state as real\n"
        "import onceflow.state\n"
        "from onceflow.state import ValueSpec\n"
        "from onceflow import *\n"
        "names = {n: type(getattr(onceflow, n)).__name__ for n in onceflow.__all__}\n"
        "print(json.dumps({\n"
        "    'names': names,\n"
        "    'same': onceflow.state is real and onceflow.state.__spec__.name == real.__name__,\n"
        "    'star': all(n in globals() for n in onceflow.__all__),\n"
        "    'spec': ValueSpec is real.ValueSpec,\n"
        "}))\n"
    )
    found = json.loads(out)
    assert found["same"] and found["star"]
    assert found["spec"]
    assert found["names"]["Pipeline"] == "type"
    assert found["names"]["windows"] == "module"

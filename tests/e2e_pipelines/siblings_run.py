"""How the tests run ``siblings.py``: its pipeline name, topics, environment and arguments."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

PIPELINE = str(Path(__file__).with_name("siblings.py"))


@dataclass(frozen=True)
class SiblingsRun:
    """One namespace of the siblings pipeline: ``topics`` by role (in, alerts, out)."""

    name: str
    topics: dict[str, str]
    env: dict[str, str]
    args: list[str]


def siblings_run(prefix: str, bootstrap: str, redis_url: str, tmp_path: Path | str) -> SiblingsRun:
    """A new pipeline name and its topics; a bounded run (``--available-now``) in ``tmp_path``."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    topics = {k: f"{name}-{k}" for k in ("in", "alerts", "out")}
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "SIB_PIPELINE": name,
        "SIB_IN": topics["in"],
        "SIB_ALERTS": topics["alerts"],
        "SIB_OUT": topics["out"],
    }
    args = ["--available-now", "--redis-url", redis_url]
    args += ["--checkpoint", os.path.join(str(tmp_path), "checkpoint")]
    args += ["--output-dir", os.path.join(str(tmp_path), "out")]
    return SiblingsRun(name, topics, env, args)

"""A pipeline whose records are dataclasses and named tuples, across every stage boundary.

Loaded by ``onceflow.cli.loader`` (module ``__onceflow__``, not importable in a worker), so
the classes reach the workers only with the pipeline: what a user's pipeline file does.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from onceflow import Pipeline, sinks, sources
from onceflow.pipeline.combiners import ToList


@dataclasses.dataclass(frozen=True)
class Click:
    user: str
    page: str
    ms: int


class Visit(NamedTuple):
    user: str
    ms: int


def build() -> Pipeline:
    p = Pipeline("records")
    clicks = p.read("in", sources.Collection([f"u{i % 3},/p{i % 4},{i}" for i in range(30)]))
    parsed = clicks.map("parse", lambda s: Click(*s.split(",")[:2], int(s.split(",")[2])))
    parsed.map("visit", lambda c: Visit(c.user, c.ms)).write("visits", sinks.Collect())
    keyed = parsed.key_by("by-user", lambda c: c.user)  # the clicks cross a shuffle
    keyed.combine_per_key("clicks", ToList()).write("per-user", sinks.Collect())
    return p

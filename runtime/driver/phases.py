"""Where a step of a streaming run spent its time (start-up, or one micro-batch)."""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)


class Phases:
    """Where a step's time went: seconds per named phase, and Spark jobs and stages."""

    def __init__(self, start: float | None = None) -> None:
        self.last = time.monotonic() if start is None else start
        self.seconds: dict[str, float] = {}
        self.jobs = self.stages = 0

    def mark(self, name: str) -> None:
        """The phase ``name`` ended now."""
        now = time.monotonic()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now

    def count_jobs(self, spark: Any, group: str) -> None:
        """Spark jobs and stages of a job group (monitoring only: never fails a batch)."""
        try:
            tracker = spark.sparkContext.statusTracker()
            jobs = tracker.getJobIdsForGroup(group)
            self.jobs = len(jobs)
            infos = [tracker.getJobInfo(j) for j in jobs]
            self.stages = sum(len(i.stageIds) for i in infos if i is not None)
        except Exception as exc:  # noqa: BLE001
            log.debug("no job count for %s: %s", group, exc)

    def describe(self) -> str:
        """``plan 0.05 s, spark 0.61 s, ...; 1 Spark job(s), 3 stage(s)``."""
        parts = ", ".join(f"{k} {v:.3f} s" for k, v in self.seconds.items())
        return f"{parts}; {self.jobs} Spark job(s), {self.stages} stage(s)"

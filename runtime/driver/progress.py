"""Progress for long runs: a bar of Spark tasks for bounded runs, a line per micro-batch."""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from pyspark import SparkContext


class TaskProgress:
    """Polls Spark's status tracker for a job group and draws a tqdm bar of tasks."""

    def __init__(
        self,
        sc: SparkContext,
        group: str,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        interval: float = 0.25,
    ) -> None:
        self.sc = sc
        self.group = group
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> TaskProgress:
        self.sc.setJobGroup(self.group, "onceflow run", interruptOnCancel=True)
        if self.enabled and self.stream.isatty():  # no frames into a log file
            self._thread = threading.Thread(
                target=self._loop, name="onceflow-progress", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def snapshot(self) -> tuple[int, int, int]:
        """(completed tasks, known tasks, running stages) for the group's jobs."""
        tracker = self.sc.statusTracker()
        done = total = active = 0
        for job_id in tracker.getJobIdsForGroup(self.group):
            job = tracker.getJobInfo(job_id)
            if job is None:
                continue
            for stage_id in job.stageIds:
                info = tracker.getStageInfo(stage_id)
                if info is None:
                    continue
                total += info.numTasks
                done += info.numCompletedTasks
                active += 1 if info.numActiveTasks else 0
        return done, total, active

    def _loop(self) -> None:
        from tqdm import tqdm

        bar: Any = tqdm(
            total=0, unit="task", file=self.stream, leave=False, desc="running", dynamic_ncols=True
        )
        try:
            while not self._stop.wait(self.interval):
                done, total, active = self.snapshot()
                if total != bar.total:
                    bar.total = total
                bar.n = done
                bar.set_postfix_str(f"{active} stage(s) active", refresh=False)
                bar.refresh()
        finally:
            bar.close()

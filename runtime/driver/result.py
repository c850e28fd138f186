"""What a run did (:class:`RunResult`), and how a failed run is told to a person."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from onceflow.kernel.records import Guarantee
from onceflow.runtime.errors import TASK_FAILURE_MARK
from onceflow.runtime.metrics import split_counter
from onceflow.runtime.spec import Job

MAX_LINE = 800


@dataclass
class RunResult:
    """What a run did."""

    pipeline: str
    job: Job
    mode: Guarantee
    seconds: float
    counters: dict[str, int]
    dead_letter_sink: str
    batches: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def counter(self, name: str) -> int:
        """Total of counters whose name ends with ``/name``."""
        return sum(n for k, n in self.counters.items() if k.endswith("/" + name))

    @property
    def records_in(self) -> int:
        """Records read by source stages."""
        return sum(self.counters.get(f"{s}/in", 0) for s in self.job.source_stages)

    @property
    def dead_letters(self) -> int:
        """Records sent to the dead-letter sink."""
        return self.counter("dead_letters")

    @property
    def restamped(self) -> dict[str, int]:
        """Per sink: records stamped with the time of writing, not their event time.

        Their topic would have deleted (retention) or refused (timestamp limits) their event
        time; it travels in their ``onceflow-ts`` header (see the Kafka sink).
        """
        out: dict[str, int] = {}
        for key, n in self.counters.items():
            _stage, name = split_counter(key, (stage.name for stage in self.job.stages))
            if name.startswith("restamped/"):
                sink = name[len("restamped/") :]
                out[sink] = out.get(sink, 0) + n
        return out

    def stage_rows(self) -> list[tuple[str, int, int, int, int]]:
        """Per stage: (name, records in, records out, dead letters, duplicates dropped)."""
        rows = []
        for stage in self.job.stages:
            prefix = stage.name + "/"
            out = sum(
                n
                for k, n in self.counters.items()
                if k.startswith(prefix + "out/") and not k.endswith("/dead-letters")
            )
            rows.append(
                (
                    stage.name,
                    self.counters.get(prefix + "in", 0),
                    out,
                    self.counters.get(prefix + "dead_letters", 0),
                    self.counters.get(prefix + "duplicates_dropped", 0),
                )
            )
        return rows

    def summary(self) -> str:
        """A table of what each stage did, and the totals."""
        lines = [
            f"pipeline {self.pipeline!r}: {self.mode.value} run, {self.batches} batch(es), "
            f"{self.seconds:.1f} s",
            f"{'stage':<28} {'in':>10} {'out':>10} {'dead':>6} {'dups':>6}",
        ]
        for name, n_in, n_out, dead, dups in self.stage_rows():
            lines.append(f"{name:<28} {n_in:>10,} {n_out:>10,} {dead:>6,} {dups:>6,}")
        rate = self.records_in / self.seconds if self.seconds > 0 else 0.0
        lines.append(f"records in: {self.records_in:,} ({rate:,.0f}/s)")
        if self.dead_letters:
            lines.append(f"dead letters: {self.dead_letters:,} -> {self.dead_letter_sink}")
        else:
            lines.append("dead letters: 0")
        if self.restamped:
            where = ", ".join(f"{sink} {n:,}" for sink, n in sorted(self.restamped.items()))
            lines.append(
                f"stamped with the time of writing ({where}): their topic would delete or "
                "refuse their event time, which is in their onceflow-ts header"
            )
        return "\n".join(lines)


_OWN_ERROR = re.compile(r"\bonceflow(?:\.\w+)+\.(\w+(?:Error|Exception)):")


def explain_failure(name: str, exc: BaseException, log_path: str | None = None) -> str:
    """The useful part of a Spark failure, in one line: the failing task's own summary.

    Spark's text holds the worker's traceback and the JVM's; the task wrapped its error in a
    line starting with :data:`~onceflow.runtime.errors.TASK_FAILURE_MARK` (stage, batch,
    partition, the exception and the input record). The full text is in the log file.
    """
    text = str(exc)
    log = f" (full log: {log_path})" if log_path else ""
    if TASK_FAILURE_MARK in text:
        line = text[text.index(TASK_FAILURE_MARK) + len(TASK_FAILURE_MARK) :].splitlines()[0]
        return f"pipeline {name!r} stopped: {line.strip()}{log}"
    for raw in reversed(text.splitlines()):
        line = raw.strip()
        if line and ("Error" in line or "Exception" in line) and not line.startswith("at "):
            line = _OWN_ERROR.sub(r"\1:", line)  # onceflow.x.y.FailoverError: -> FailoverError:
            return f"pipeline {name!r} failed: {line[:MAX_LINE]}{log}"
    return f"pipeline {name!r} failed: {' '.join(text.split())[:MAX_LINE]}{log}"

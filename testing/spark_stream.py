"""A :class:`~onceflow.testing.teststream.TestStream` as a Spark Python streaming data source.

Offsets are ``{"step": s, "tick": t}``: each micro-batch reads one step of the stream. When
the streaming run asks for a tick (windows whose panes are due, see
:mod:`onceflow.runtime.driver.ticks`), the next micro-batch reads no step and only raises the tick;
ticks come before the next step. The elements themselves never travel through the data
source: a step's rows are ``(step, position)`` and the stream's decoder, shipped with the
stage, turns them into records. Before the batch of a clock step the reader moves the run's
batch clock in Redis, named in the stream's clock file (or, without one, waits that long).
The in-process evaluator (:mod:`onceflow.testing.evaluator`) schedules steps and ticks by the
same rule.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    SupportsTriggerAvailableNow,
)

from onceflow.testing.steps import CLOCK, RAW_SCHEMA, advance_clock, raw_rows, wait_clock

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

FORMAT = "onceflow_teststream"

_registered: set[int] = set()


def register(session: SparkSession) -> None:
    """Register the data source with ``session`` (once)."""
    if id(session) not in _registered:
        session.dataSource.register(TestStreamDataSource)
        _registered.add(id(session))


class TestStreamDataSource(DataSource):
    """``spark.readStream.format("onceflow_teststream").option("config", json)``."""

    __test__ = False

    @classmethod
    def name(cls) -> str:
        """Format name."""
        return FORMAT

    def schema(self) -> str:
        """``step``, ``position``."""
        return RAW_SCHEMA

    def streamReader(self, schema: Any) -> DataSourceStreamReader:  # noqa: N802 - Spark's name
        """The micro-batch reader."""
        return TestStreamReader(json.loads(self.options["config"]))


class TestStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """One step per micro-batch; ticks first (see the module docstring)."""

    __test__ = False

    def __init__(self, config: dict[str, Any]) -> None:
        self.kinds: list[list[Any]] = config["kinds"]  # [kind, rows, ms] per step
        self.tick_file: str | None = config.get("tick_file")
        self.clock_file: str | None = config.get("clock_file")
        self.ticks_seen = 0
        self.clock_moved: set[int] = set()

    def initialOffset(self) -> dict[str, int]:  # noqa: N802 - Spark's name
        """Before the first step."""
        return {"step": 0, "tick": 0}

    def getDefaultReadLimit(self) -> ReadLimit:  # noqa: N802 - Spark's name
        """Steps are the unit; no cap."""
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802 - Spark's name
        """Every step is available from the start."""

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:  # noqa: N802
        """A tick if one was asked for, else the next step, else nothing new."""
        step, tick = int(start["step"]), int(start["tick"])
        if self._tick_asked():
            return {"step": step, "tick": tick + 1}
        if step >= len(self.kinds):
            return {"step": step, "tick": tick}
        kind, _rows, ms = self.kinds[step]
        if kind == CLOCK and step not in self.clock_moved:
            self.clock_moved.add(step)
            if self.clock_file is not None:
                with open(self.clock_file) as fh:
                    clock = json.load(fh)
                advance_clock(clock["redis_url"], clock["namespace"], int(ms))
            else:
                wait_clock(int(ms))
        return {"step": step + 1, "tick": tick}

    def _tick_asked(self) -> bool:
        if self.tick_file is None:
            return False
        try:
            with open(self.tick_file) as fh:
                asked = int(fh.read().strip() or 0)
        except (OSError, ValueError):
            return False
        if asked > self.ticks_seen:
            self.ticks_seen = asked
            return True
        return False

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        """The steps in ``[start, end)`` that have rows, one input partition each."""
        return [
            InputPartition(step)
            for step in range(int(start["step"]), int(end["step"]))
            if self.kinds[step][1] > 0
        ]

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to acknowledge."""

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The rows of one step (on a worker)."""
        step = int(partition.value)
        yield raw_rows(step, int(self.kinds[step][1]))

"""What a test stream is made of: steps, and the raw rows Spark and the evaluator read.

Shared by :mod:`onceflow.testing.teststream` (building streams, decoding rows),
:mod:`onceflow.testing.spark_stream` (the Spark data source) and
:mod:`onceflow.testing.evaluator`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa

RECORDS = "records"
WATERMARK = "watermark"
CLOCK = "clock"
# Raw rows of a test stream: which step, and which element of it.
RAW_SCHEMA = "step long, position long"
SPLIT = "teststream"  # part of position-derived IDs


@dataclass(frozen=True)
class Step:
    """One micro-batch of a test stream.

    ``items`` are encoded elements with their event time (None: from the ``timestamp``
    function); ``ms`` is the watermark's target (``watermark``) or the clock's advance
    (``clock``); ``offset`` is the position of the step's first element in the stream.
    """

    kind: str
    items: tuple[tuple[bytes, int | None], ...] = ()
    ms: int = 0
    offset: int = 0

    @property
    def rows(self) -> int:
        """How many raw rows the step reads as: its elements, one heartbeat, or none."""
        if self.kind == RECORDS:
            return len(self.items)
        return 1 if self.kind == WATERMARK else 0


def lane_of(source: str) -> str:
    """The lane (watermark input) of a test stream read by source stage ``source``."""
    return f"teststream-{source}:0"


def raw_rows(step: int, rows: int) -> pa.RecordBatch:
    """The raw rows of a step: ``(step, position)`` for each of its ``rows``."""
    import pyarrow as pa

    return pa.RecordBatch.from_arrays(
        [pa.array([step] * rows, pa.int64()), pa.array(range(rows), pa.int64())],
        names=["step", "position"],
    )


def advance_clock(redis_url: str, namespace: str, ms: int) -> None:
    """Move a Spark test run's batch clock on by ``ms`` (before the batch of a clock step).

    A micro-batch's time is the later of Redis's clock and the ``time`` its predecessor
    stored (:func:`onceflow.dedup.batch.fix_batch_params`): raising the stored one moves the
    next batch's clock.
    """
    from onceflow.dedup.batch import redis_time_ms
    from onceflow.kernel.keyspace import Keyspace
    from onceflow.kernel.settings import RedisSettings, redis_client

    client = redis_client(RedisSettings.from_env(redis_url), namespace)
    key = Keyspace(namespace).clock
    stored = client.hget(key, "time")
    now = max(redis_time_ms(client), int(stored or 0))
    client.hset(key, "time", now + ms)


def wait_clock(ms: int) -> None:
    """Without a Redis to move the clock in (a stream run outside ``run_test``): wait."""
    time.sleep(ms / 1000)

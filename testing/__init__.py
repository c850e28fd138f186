"""Testing helpers for pipeline authors.

Unit tests of a pipeline's logic, with no Kafka and no Redis of yours (in process, or on
local Spark with ``mode="spark"``):

>>> from onceflow.testing import TestStream, assert_that, run_test
>>> stream = TestStream().add(orders, at=1_000).advance_watermark(60_000)
>>> out = run_test(pipeline, {"orders": stream})
>>> assert_that(out["revenue-out"]).contains_exactly([("c1", 15)])

Exactly-once under failures, against real services: crash a run at a chosen point, resume,
compare (Linux: it kills every process of the run's session, found through ``/proc``):

>>> from onceflow.testing import Crash, crash_and_resume, compare_counts, LocalRedis
"""

from __future__ import annotations

from onceflow.runtime.faults import POINTS
from onceflow.testing.asserts import Assertion, assert_that, equal_to, is_empty
from onceflow.testing.errors import TestingError, TestInputError
from onceflow.testing.harness import (
    Crash,
    KillAfter,
    Outcome,
    Report,
    compare_counts,
    crash_and_resume,
    kill_session,
    run_pipeline,
    session_processes,
)
from onceflow.testing.kafka import LocalKafka
from onceflow.testing.kafka_cluster import LocalKafkaCluster
from onceflow.testing.kafka_jars import fetch_kafka
from onceflow.testing.redis_cluster import LocalRedisCluster
from onceflow.testing.run import TestOutputs, run_test
from onceflow.testing.services import LocalBroker, LocalRedis, free_port
from onceflow.testing.spark_cluster import LocalSparkCluster
from onceflow.testing.state import keyed_state
from onceflow.testing.teststream import TestStream

__all__ = [
    "POINTS",
    "Assertion",
    "Crash",
    "KillAfter",
    "LocalBroker",
    "LocalKafka",
    "LocalKafkaCluster",
    "LocalRedis",
    "LocalRedisCluster",
    "LocalSparkCluster",
    "Outcome",
    "Report",
    "TestInputError",
    "TestOutputs",
    "TestStream",
    "TestingError",
    "assert_that",
    "compare_counts",
    "crash_and_resume",
    "equal_to",
    "fetch_kafka",
    "free_port",
    "is_empty",
    "keyed_state",
    "kill_session",
    "run_pipeline",
    "run_test",
    "session_processes",
]

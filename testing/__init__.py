"""Testing helpers for pipeline authors: real local services, crash-and-resume, counts.

>>> from onceflow.testing import Crash, crash_and_resume, compare_counts, LocalRedis
"""

from __future__ import annotations

from onceflow.testing.cluster import LocalRedisCluster, LocalSparkCluster
from onceflow.testing.harness import (
    POINTS,
    Crash,
    Outcome,
    Report,
    compare_counts,
    crash_and_resume,
    kill_session,
    run_pipeline,
    session_processes,
)
from onceflow.testing.kafka import LocalKafka, fetch_kafka
from onceflow.testing.services import LocalBroker, LocalRedis, free_port

__all__ = [
    "POINTS",
    "Crash",
    "LocalBroker",
    "LocalKafka",
    "LocalRedis",
    "LocalRedisCluster",
    "LocalSparkCluster",
    "Outcome",
    "Report",
    "compare_counts",
    "crash_and_resume",
    "fetch_kafka",
    "free_port",
    "kill_session",
    "run_pipeline",
    "session_processes",
]

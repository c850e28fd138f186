"""A stage read by two others, killed and retried (issue 37, R1), on local Spark.

``tests/e2e_pipelines/two_readers.py``: ``orders`` is read by a keyed count and by a merge
after ``payments``. Spark persists it and runs it in whichever reader's task needs it first;
its partition must be its own either way (:mod:`onceflow.runtime.driver.compile`), or a
recomputation under the other reader's index drops its records as copies (IDs) or writes its
sinks twice (positions). Each run is checked against the count ``tests/exactly_once/two_readers.py``
makes of the input. The same pipeline on a Spark standalone cluster, with a worker killed:
``tests/cluster/test_two_readers_on_cluster.py``.
"""

from __future__ import annotations

import pytest

from onceflow.testing.harness import Crash, crash_and_resume, run_pipeline
from tests.exactly_once.two_readers import PIPELINE, make_two_readers, verify

pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]


LONG = pytest.mark.long  # the same proof at another point or with position IDs


@pytest.mark.parametrize(
    "crash",
    [
        pytest.param(
            Crash("after_commit", stage="orders", batch=1, partition=1, mode="raise"),
            id="orders-after-commit",
        ),
        pytest.param(
            Crash("after_sink_write", stage="orders", batch=1, partition=2, mode="raise"),
            id="orders-after-sink-write",
            marks=LONG,
        ),
        pytest.param(
            Crash("after_commit", stage="all", batch=1, partition=3, mode="raise"),
            id="merge-after-commit",
            marks=LONG,
        ),
        pytest.param(
            Crash("after_finish", stage="orders-per-user", batch=1, partition=0, mode="raise"),
            id="count-finish",
            marks=LONG,
        ),
    ],
)
def test_task_retries_of_a_stage_read_twice_are_exact(broker, redis_server, tmp_path, crash):
    """``local[2,3]``: the task fails at the point once, Spark runs it again."""
    scn = make_two_readers(broker, redis_server.url, tmp_path)
    outcome = run_pipeline(PIPELINE, scn.args("local[2,3]"), env=scn.env, crash=crash).check()
    assert outcome.returncode == 0
    assert outcome.where, "the crash point was never reached:\n" + outcome.output[-3000:]
    verify(scn, redis_server.client())


@pytest.mark.parametrize(
    "by_position", [False, pytest.param(True, marks=LONG)], ids=["ids", "positions"]
)
def test_a_stage_read_twice_killed_and_rerun_is_exact(broker, redis_server, tmp_path, by_position):
    """Every process killed with -9 after ``orders`` committed in batch 1, then run again."""
    scn = make_two_readers(broker, redis_server.url, tmp_path, by_position=by_position)
    crash = Crash("after_commit", stage="orders", batch=1, partition=0)
    first, second = crash_and_resume(PIPELINE, crash, scn.args(), env=scn.env)
    assert first.crashed and second.returncode == 0
    verify(scn, redis_server.client())

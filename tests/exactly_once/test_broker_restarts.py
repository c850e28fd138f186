"""A Kafka broker restarted while a run is mid-way: the run rides it out and stays exact.

Each test runs ``tests/e2e_pipelines/totals.py`` (a copy of every event through a
transactional sink, a keyed total per user, dead letters) on Kafka of its own with Spark's
default master (a failed task fails the run: no retry hides anything), takes Kafka away while
a task of micro-batch 2 holds a transaction open (its records sent, its delivery marker not
yet), brings it back on the same data, and requires the run to finish by itself (exit status
0, no rerun) with outputs that match an independent count (``real_input.verify``: keyed state,
each user's last total, one copy per event, read ``read_committed``; in the single broker's
test also every other sink: Parquet, JSON lines, Iceberg, PostgreSQL). The run goes on through
the fault (planning, reading and writing later batches) and cannot end before it: the last
event of each partition waits for the fault to be over (``TOTALS_GATE``).

* a single broker killed with -9 and started again 10 s later (down ~15-20 s with its
  restart): the open transactions, the next batches' planning and reading meet the outage;
* a three-node KRaft cluster (replication factor 3, ``min.insync.replicas`` 2) through a
  rolling restart: each node killed with -9 and started again in turn (once the replicas are
  back in sync), moving leaders and transaction coordinators under the run.

Before the ride-out, the first stopped the run after ~140 s with "Kafka refused a send to
'...-copy' in a transaction: the delivery marker was not written": kafka-python 3.0's
transactional producer never sent the marker it was given while the coordinator was away, and
expired it after its 120 s delivery timeout.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from onceflow.runtime.faults import PAUSE_ENV
from onceflow.testing.harness import Crash, Outcome, run_pipeline
from onceflow.testing.kafka import LocalKafka
from onceflow.testing.kafka_cluster import LocalKafkaCluster
from onceflow.testing.services import free_port
from tests.exactly_once.real_input import PIPELINE, Run, Send, event, new_run, sinks_env, verify

pytestmark = [pytest.mark.kafka, pytest.mark.redis]

CAP = 300  # records per micro-batch
# Input for ~10 batches; the last event of each partition waits until the fault is over
# (TOTALS_GATE), so the run goes on through the fault and cannot end before it.
EVENTS = 3000
SLOW_MS = "1"  # per record in enrich: ~0.15 s of work per batch and partition
DOWN_S = 10.0  # how long the killed broker stays down before it is started again
NODE_DOWN_S = 2.0  # in a rolling restart, each node (its restart takes ~8 s more)
PAUSE_S = "1"  # the paused task goes on this long after the fault began


@pytest.fixture
def cluster() -> Iterator[LocalKafkaCluster]:
    with LocalKafkaCluster(brokers=3) as nodes:
        yield nodes


def _input(run: Run, gate: str) -> None:
    run.cap = CAP
    run.extra_env.update(TOTALS_SLOW_MS=SLOW_MS, TOTALS_GATE=gate)
    sends = [Send(event(run, f"u{i % 23}", 1 + i % 5), i % 2) for i in range(EVENTS)]
    sends += [Send(event(run, "u0", 1, gate=True), p) for p in (0, 1)]
    run.produce(sends)


class Outage:
    """A fault made while one task of the run waits inside a sink transaction.

    The run pauses a task of micro-batch ``batch`` right after it sent its records, before
    it flushes them and writes the delivery marker (``in_sink_transaction``), for
    :data:`PAUSE_S`; the fault starts meanwhile and takes longer: the task goes on into a
    Kafka that is away, and the rest of the run (the other partition, the next batches'
    planning) meets it too.
    """

    def __init__(self, fault: Callable[[], None], gate: str, batch: int = 2) -> None:
        self.fault = fault
        self.gate = gate  # created once the fault is over: the run's last events wait for it
        self.crash = Crash("in_sink_transaction", stage="events", batch=batch, mode="pause")
        self.ended: float | None = None

    def __call__(self) -> None:
        try:
            self.fault()
            self.ended = time.monotonic()
        finally:
            with open(self.gate, "w", encoding="utf-8"):
                pass


def _run_through(run: Run, outage: Outage) -> tuple[Outcome, float]:
    """Run the pipeline to its end with the outage under it; the run's end, monotonic."""
    env = {**run.env, PAUSE_ENV: PAUSE_S}
    # Spark's default: a failed task fails the run (no retry could hide a failure here)
    args = [arg if arg != "local[2,4]" else "local[2]" for arg in run.args()]
    args = [arg for arg in args if arg != "--no-progress"]  # the batches' lines
    began = time.monotonic()
    outcome = run_pipeline(PIPELINE, args, env=env, crash=outage.crash, fault=outage, timeout=480)
    with open(os.path.join(run.workdir, "run-output.txt"), "w", encoding="utf-8") as fh:
        fh.write(outcome.output)  # the batches' times and the waits, for a look afterwards
    return outcome, began + outcome.seconds


def _check(run: Run, outcome: Outcome, finished: float, outage: Outage, client) -> None:
    assert not outcome.crashed and outcome.returncode == 0, outcome.output[-4000:]
    assert outage.ended is not None, "the run never reached the point of the outage"
    assert finished > outage.ended, "the run ended before Kafka was back"
    verify(run, client)


def _kill_and_restart(kafka: LocalKafka, down_s: float = DOWN_S) -> Callable[[], None]:
    def fault() -> None:
        kafka.kill()
        time.sleep(down_s)
        kafka.start()

    return fault


def _rolling_restart(nodes: LocalKafkaCluster) -> Callable[[], None]:
    def fault() -> None:
        for i in range(len(nodes.nodes)):
            nodes.kill(i)
            time.sleep(NODE_DOWN_S)
            nodes.start_node(i)
            nodes.wait_in_sync()  # as an operator does before taking the next one down

    return fault


# CI time (~55 s): the default suite restarts the broker in the soak round
# (tests/exactly_once/test_soak.py) and mid-read and mid-write in test_kafka_outages.py
@pytest.mark.long
@pytest.mark.parametrize("client", ["python", "confluent"])
def test_a_broker_killed_and_restarted_mid_run_is_ridden_out(
    client, own_broker, redis_server, postgres_server, tmp_path
):
    # the enriched events also go to every other sink, each read back by its own reader in
    # the check (pyarrow, plain file reads, pyiceberg, psycopg)
    more = sinks_env(str(tmp_path), postgres=postgres_server.env)
    run = new_run(own_broker, redis_server.url, tmp_path, TOTALS_CLIENT=client, **more)
    gate = str(tmp_path / "fault-over")
    _input(run, gate)
    outage = Outage(_kill_and_restart(own_broker), gate)
    outcome, finished = _run_through(run, outage)
    _check(run, outcome, finished, outage, redis_server.client())


@pytest.mark.long
def test_a_broker_down_for_a_minute_is_ridden_out(own_broker, redis_server, tmp_path):
    """Longer than the transactions' timeout (60 s): the coordinator aborts them itself."""
    run = new_run(own_broker, redis_server.url, tmp_path)
    gate = str(tmp_path / "fault-over")
    _input(run, gate)
    outage = Outage(_kill_and_restart(own_broker, down_s=55.0), gate)
    outcome, finished = _run_through(run, outage)
    _check(run, outcome, finished, outage, redis_server.client())


# CI time: the single broker's restart above runs by default; the rolling restart with --long
@pytest.mark.long
@pytest.mark.parametrize("client", ["python", "confluent"])
def test_a_rolling_restart_of_a_three_node_cluster_is_ridden_out(
    client, cluster, redis_server, tmp_path
):
    run = new_run(cluster, redis_server.url, tmp_path, TOTALS_CLIENT=client)
    gate = str(tmp_path / "fault-over")
    _input(run, gate)
    outage = Outage(_rolling_restart(cluster), gate)
    outcome, finished = _run_through(run, outage)
    _check(run, outcome, finished, outage, redis_server.client())


def test_a_broker_down_at_start_ends_the_run_in_one_line_after_the_wait(redis_server, tmp_path):
    """Before Spark starts: a progress line while waiting, then one ``error:`` line.

    It was a 50-line traceback (``KafkaTimeoutError: Unable to bootstrap`` from
    ``ensure_topics``), after the Spark session had started.
    """
    run = Run("down-at-start", f"127.0.0.1:{free_port()}", redis_server.url, str(tmp_path))
    outcome = run_pipeline(PIPELINE, [*run.args(), "--kafka-start-wait", "8s"], env=run.env)
    lines = [line for line in outcome.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert outcome.returncode == 1 and len(errors) == 1, outcome.output[-3000:]
    assert run.bootstrap in errors[0] and "did not answer for 8 s" in errors[0]
    waits = [line for line in lines if line.startswith("onceflow: waiting for Kafka at")]
    assert waits and lines == [*waits, *errors], outcome.output[-3000:]


@pytest.mark.long  # the wait itself: tests/connectors/test_kafka_outages.py
def test_a_broker_that_comes_up_during_the_start_wait_lets_the_run_proceed(
    own_broker, redis_server, tmp_path
):
    run = new_run(own_broker, redis_server.url, tmp_path)
    run.produce([Send(event(run, f"u{i % 5}", 1), i % 2) for i in range(600)])
    own_broker.stop()

    def start_later() -> None:
        time.sleep(3)
        own_broker.start()

    threading.Thread(target=start_later, daemon=True).start()
    outcome = run_pipeline(PIPELINE, [*run.args(), "--kafka-start-wait", "2m"], env=run.env)
    assert outcome.returncode == 0, outcome.output[-3000:]
    verify(run, redis_server.client())

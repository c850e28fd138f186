"""How long a run takes to ride out a Kafka broker restart: numbers, several runs.

Runs ``tests/e2e_pipelines/totals.py`` (a transactional copy of every event and a keyed total
per user) as the broker-restart tests do (``tests/exactly_once/test_broker_restarts.py``): a
task of micro-batch 2 pauses inside its sink transaction, the broker is killed with -9
meanwhile and started again ``--down`` seconds later (or, with ``--cluster``, the three nodes
of a KRaft cluster in turn), and the run goes on by itself. Prints per run:

* ``away``: from the kill to the broker answering again (its own restart included);
* ``ride-out``: from the kill to the end of the micro-batch it hit, and ``after``: how much
  of that came after the broker was back (reconnecting, a stuck producer noticed and
  replaced, the transaction redone);
* the run's exit status, whether the independent count matched, and its length.

    python bench/kafka_restarts.py [--runs 3] [--client python|confluent] [--down 10] [--cluster]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis as redis_py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

from onceflow.runtime.faults import PAUSE_ENV  # noqa: E402
from onceflow.testing.harness import Crash, run_pipeline  # noqa: E402
from onceflow.testing.kafka import LocalKafka  # noqa: E402
from onceflow.testing.kafka_cluster import LocalKafkaCluster  # noqa: E402
from onceflow.testing.services import LocalRedis  # noqa: E402
from tests.exactly_once.real_input import PIPELINE, Send, event, new_run, verify  # noqa: E402

EVENTS = 3000
CAP = 300
BATCH_LINE = re.compile(r"\] batch (\d+): .* ([\d.]+) s \(")


@dataclass
class Timeline:
    """When the fault began and ended, and when each micro-batch line came."""

    killed: float = 0.0
    back: float = 0.0
    batches: list[tuple[float, int]] = field(default_factory=list)
    waits: int = 0

    def echo(self, line: str) -> None:
        found = BATCH_LINE.search(line)
        if found:
            self.batches.append((time.monotonic(), int(found.group(1))))
        elif "waiting for Kafka" in line:
            self.waits += 1

    def batch_end_after_kill(self) -> float:
        return min(t for t, _ in self.batches if t > self.killed)


def _fault(kafka: Any, cluster: bool, down_s: float, timeline: Timeline, gate: str) -> Callable:
    def fault() -> None:
        timeline.killed = time.monotonic()
        if cluster:
            for i in range(len(kafka.nodes)):
                kafka.kill(i)
                time.sleep(down_s)
                kafka.start_node(i)
                kafka.wait_in_sync()
        else:
            kafka.kill()
            time.sleep(down_s)
            kafka.start()
        timeline.back = time.monotonic()
        with open(gate, "w", encoding="utf-8"):
            pass

    return fault


def one_run(client: str, down_s: float, cluster: bool, redis: LocalRedis) -> dict[str, Any]:
    """One run with the fault under it; its numbers."""
    with tempfile.TemporaryDirectory(prefix="onceflow-bench-restart-") as work:
        kafka: Any = LocalKafkaCluster() if cluster else LocalKafka()
        with kafka:
            run = new_run(kafka, redis.url, work, TOTALS_CLIENT=client)
            gate = os.path.join(work, "fault-over")
            run.cap = CAP
            run.extra_env.update(TOTALS_SLOW_MS="1", TOTALS_GATE=gate)
            sends = [Send(event(run, f"u{i % 23}", 1 + i % 5), i % 2) for i in range(EVENTS)]
            sends += [Send(event(run, "u0", 1, gate=True), p) for p in (0, 1)]
            run.produce(sends)
            timeline = Timeline()
            args = [a if a != "local[2,4]" else "local[2]" for a in run.args()]
            args = [a for a in args if a != "--no-progress"]
            crash = Crash("in_sink_transaction", stage="events", batch=2, mode="pause")
            began = time.monotonic()
            outcome = run_pipeline(
                PIPELINE,
                args,
                env={**run.env, PAUSE_ENV: "1"},
                crash=crash,
                fault=_fault(kafka, cluster, down_s, timeline, gate),
                echo=timeline.echo,
                timeout=900,
            )
            exact = False
            if outcome.returncode == 0:
                try:
                    verify(run, redis_py.Redis.from_url(redis.url))
                    exact = True
                except AssertionError as exc:
                    print(f"  count differs: {exc}", file=sys.stderr)
            end = timeline.batch_end_after_kill() if timeline.batches else float("nan")
            return {
                "away": timeline.back - timeline.killed,
                "ride_out": end - timeline.killed,
                "after": end - timeline.back,
                "waits": timeline.waits,
                "status": outcome.returncode,
                "exact": exact,
                "run": time.monotonic() - began,
            }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--client", default="python", choices=("python", "confluent"))
    parser.add_argument("--down", type=float, default=10.0, help="seconds a broker stays killed")
    parser.add_argument("--cluster", action="store_true", help="3 nodes, a rolling restart")
    args = parser.parse_args()
    redis = LocalRedis().start()
    rows = []
    try:
        for n in range(args.runs):
            row = one_run(args.client, args.down, args.cluster, redis)
            rows.append(row)
            print(
                f"run {n + 1}: away {row['away']:.1f} s, ride-out {row['ride_out']:.1f} s "
                f"(after it was back {row['after']:.1f} s), {row['waits']} progress lines, "
                f"exit {row['status']}, exact {row['exact']}, run {row['run']:.0f} s",
                flush=True,
            )
    finally:
        redis.stop()
    for key in ("away", "ride_out", "after"):
        values = [r[key] for r in rows]
        print(
            f"{key}: median {statistics.median(values):.1f} s, "
            f"min {min(values):.1f} s, max {max(values):.1f} s"
        )
    return 0 if all(r["status"] == 0 and r["exact"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""``onceflow demo``: a streaming keyed count that is killed mid-run and still counts once.

With no configuration it starts its own Redis (AOF on) and Kafka-protocol broker; with
``REDIS_URL`` / ``KAFKA_BOOTSTRAP_SERVERS`` set it uses those. It produces events of which
some are sent twice by an at-least-once producer (same event ID, new offsets), runs
:mod:`pipeline.demo.orders_pipeline` as a separate process, kills that process with SIGKILL
after a micro-batch's sink writes but before Spark commits the batch, runs it again, and then
compares what it wrote with an independent count of the input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce, read_topic
from onceflow.kernel import codec
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.scopes import node_state
from onceflow.kernel.settings import RedisSettings, redis_client
from onceflow.operations.audit import audit
from onceflow.runtime.spark_env.session import DEFAULT_MASTER
from onceflow.testing.harness import Crash, compare_counts, crash_and_resume
from onceflow.testing.kafka import LocalKafka
from onceflow.testing.kafka_jars import KAFKA_VERSION
from onceflow.testing.services import LocalRedis

PIPELINE_FILE = os.path.join(os.path.dirname(__file__), "orders_pipeline.py")
USERS = 40
DUPLICATE_SHARE = 0.05
BATCH = 4000


def say(text: str = "") -> None:
    """Print a line of the demo's story."""
    print(text, flush=True)


@contextlib.contextmanager
def services(workdir: str) -> Iterator[tuple[str, str]]:
    """Redis URL and Kafka bootstrap: configured ones, or local processes started here."""
    with contextlib.ExitStack() as stack:
        redis_url = os.environ.get("REDIS_URL")
        if not redis_url:
            local = LocalRedis(os.path.join(workdir, "redis"))
            os.makedirs(local.directory, exist_ok=True)
            stack.enter_context(local)
            redis_url = local.url
            say(f"started redis-server (AOF on) at {redis_url}")
        else:
            say(f"using Redis at {redis_url.split('@')[-1]}")
        bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
        if not bootstrap:
            broker = stack.enter_context(LocalKafka())
            bootstrap = broker.bootstrap
            say(f"started Apache Kafka {KAFKA_VERSION} (KRaft, one node) at {bootstrap}")
        else:
            say(f"using Kafka at {bootstrap}")
        yield redis_url, bootstrap


def make_events(n: int, rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Unique events, and the order an at-least-once producer sends them in (with repeats)."""
    now = int(time.time() * 1000)
    events = [
        {
            "event_id": str(uuid.uuid4()),
            "user": f"user-{rng.randrange(USERS):02d}",
            "amount": rng.randrange(1, 500),
            "ts": now + i,
        }
        for i in range(n)
    ]
    sends = list(events)
    for e in rng.sample(events, int(n * DUPLICATE_SHARE)):
        sends.insert(min(len(sends), events.index(e) + rng.randrange(1, 3 * BATCH)), e)
    return events, sends


def main(args: argparse.Namespace) -> int:
    """Run the demo; exit 0 only when nothing was lost and nothing duplicated."""
    rng = random.Random(42)
    run_id = uuid.uuid4().hex[:6]
    workdir = tempfile.mkdtemp(prefix="onceflow-demo-")
    name = f"demo-{run_id}"
    env = {"DEMO_PIPELINE": name, "DEMO_EVENTS": f"{name}-events", "DEMO_COUNTS": f"{name}-counts"}
    say("Onceflow exactly-once demo")
    say("=" * 60)
    with services(workdir) as (redis_url, bootstrap):
        env["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
        kafka = KafkaSettings.from_env(bootstrap)
        events, sends = make_events(args.events, rng)
        produce(
            kafka,
            env["DEMO_EVENTS"],
            [(None, json.dumps(e).encode(), None) for e in sends],
            partitions=2,
        )
        say(
            f"produced {len(sends):,} records to {env['DEMO_EVENTS']}: {len(events):,} events, "
            f"{len(sends) - len(events):,} of them sent twice (same event_id, new offsets)"
        )
        os.environ.update(env)
        _show_plan()
        batch = max(100, min(BATCH, len(sends) // 5))  # at least 5 micro-batches
        cli = [
            "--available-now",
            "--max-records-per-batch",
            str(batch),
            "--redis-url",
            redis_url,
            "--checkpoint",
            os.path.join(workdir, "checkpoint"),
            "--output-dir",
            os.path.join(workdir, "out"),
            "--master",
            args.master,
            "--log-level",
            getattr(args, "log_level", "warn"),
            *(f"--conf={c}" for c in getattr(args, "conf", None) or []),
        ]
        crash = Crash("batch_end", batch=2)
        say(
            "run 1: will be killed with SIGKILL at the end of micro-batch 2, after its sink "
            "writes and before Spark commits it"
        )
        first, second = crash_and_resume(PIPELINE_FILE, crash, cli, env=env, echo=_echo)
        say(f"run 1: killed after {first.seconds:.0f} s ({first.where.strip()})")
        say(f"run 2: resumed from the checkpoint and Redis, finished in {second.seconds:.0f} s")
        return _report(events, sends, env, kafka, redis_url)


def _show_plan() -> None:
    from onceflow.cli.loader import load_pipeline
    from onceflow.graph_optimizer.draw import physical_text

    say("")
    say(physical_text(load_pipeline(PIPELINE_FILE).plan()))
    say("")


def _echo(line: str) -> None:
    if "] batch " in line or "error" in line.lower():
        say("    " + line.strip())


def _report(
    events: list[dict[str, Any]],
    sends: list[dict[str, Any]],
    env: dict[str, str],
    kafka: KafkaSettings,
    redis_url: str,
) -> int:
    expected = Counter(e["user"] for e in events)
    ks = Keyspace(env["DEMO_PIPELINE"])
    settings = RedisSettings(redis_url)
    client = redis_client(settings, ks.namespace)
    stored = node_state(client, ks.namespace, "count", lambda tag: redis_client(settings, tag))
    state: dict[str, int] = {codec.decode(k): codec.decode(v) for k, v in stored.items()}
    outputs = read_topic(kafka, env["DEMO_COUNTS"])
    latest: dict[str, int] = {}
    for rec in outputs:
        user = (rec.key or b"").decode()
        latest[user] = max(latest.get(user, 0), json.loads(rec.value or b"0"))
    stats = {k.decode(): int(v) for k, v in client.hgetall(ks.stats("events")).items()}
    by_state = compare_counts(expected, state)
    by_topic = compare_counts(expected, latest)
    aud = audit(kafka, env["DEMO_COUNTS"])
    rows = [
        ("input records (with upstream duplicates)", f"{len(sends):,}"),
        ("upstream duplicates dropped", f"{stats.get('duplicates', 0):,}"),
        ("unique events counted", f"{sum(state.values()):,} (independent count: {len(events):,})"),
        (
            f"outputs written to {env['DEMO_COUNTS']}",
            f"{len(outputs):,} count updates, {aud.distinct_ids:,} distinct IDs",
        ),
        ("sink copies from the crash window", f"{aud.extra_copies:,} (same ID, same value)"),
        ("lost", f"{max(by_state.lost_total, by_topic.lost_total):,}"),
        ("duplicated", f"{max(by_state.duplicated_total, by_topic.duplicated_total):,}"),
    ]
    say("")
    width = max(len(r[0]) for r in rows)
    for label, value in rows:
        say(f"  {label:<{width}}  {value}")
    ok = by_state.ok and by_topic.ok and aud.conflicting_ids == 0
    say("")
    say(
        "exactly once: every event counted once, despite the duplicates and the kill -9"
        if ok
        else f"NOT exactly once: state {by_state}; topic {by_topic}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--master", default=DEFAULT_MASTER)
    sys.exit(main(parser.parse_args()))

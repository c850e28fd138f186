"""The scenario of a stage read by two others (``tests/e2e_pipelines/two_readers.py``).

Orders and payments of 17 users are produced to two topics (orders on three partitions,
payments on two, so the orders' place in the merge's union differs from their own); with
record IDs, ``resent_percent`` of each are sent twice (same ``event_id``, new offsets,
sometimes another partition). ``verify`` compares, with a count made here from what was sent:
both keyed counts in Redis, the last count each counts topic emitted per user (read
``read_committed``: nothing lost), every record ID of the three output topics written once
with one value (nothing written twice), and the order copies (one per order).
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce, read_topic
from onceflow.kernel import codec
from onceflow.kernel.scopes import node_state
from onceflow.testing.harness import compare_counts

PIPELINE = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "e2e_pipelines", "two_readers.py"
)
USERS = 17
ORDER_PARTITIONS = 3
PAYMENT_PARTITIONS = 2
# Event times of a few hours ago: inside the dedup horizon, not ahead of the clock.
BASE_TS = (int(time.time()) // 3600 - 3) * 3_600_000


@dataclass
class TwoReaders:
    """One test's topics, pipeline name and what it sent."""

    name: str
    bootstrap: str
    redis_url: str
    workdir: str
    by_position: bool
    orders: list[dict] = field(default_factory=list)  # as sent (copies included)
    payments: list[dict] = field(default_factory=list)
    extra_env: dict = field(default_factory=dict)

    @property
    def topics(self) -> dict[str, str]:
        names = ("orders", "payments", "order-copy", "order-counts", "all-counts")
        return {k: f"{self.name}-{k}" for k in names}

    @property
    def env(self) -> dict[str, str]:
        t = self.topics
        env = {
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "TWO_READERS_PIPELINE": self.name,
            "TWO_READERS_ORDERS": t["orders"],
            "TWO_READERS_PAYMENTS": t["payments"],
            "TWO_READERS_ORDER_COPY": t["order-copy"],
            "TWO_READERS_ORDER_COUNTS": t["order-counts"],
            "TWO_READERS_ALL_COUNTS": t["all-counts"],
            **self.extra_env,
        }
        if self.by_position:
            env["TWO_READERS_IDS"] = "position"
        return env

    def args(self, master: str = "local[2]", per_batch: int = 600) -> list[str]:
        return [
            "--available-now",
            "--max-records-per-batch",
            str(per_batch),
            "--redis-url",
            self.redis_url,
            "--checkpoint",
            os.path.join(self.workdir, "checkpoint"),
            "--output-dir",
            os.path.join(self.workdir, "out"),
            "--master",
            master,
        ]

    def counted(self, events: list[dict]) -> Counter:
        """Per user, the events a count must reach: each ID once (each record by position)."""
        if self.by_position:
            return Counter(e["user"] for e in events)
        return Counter(e["user"] for e in {e["event_id"]: e for e in events}.values())


def make_two_readers(
    broker,
    redis_url,
    tmp_path,
    *,
    orders=1200,
    payments=800,
    resent_percent=5,
    seed=11,
    by_position=False,
) -> TwoReaders:
    """Produce the orders and payments (copies only where records have IDs)."""
    rng = random.Random(seed)
    scn = TwoReaders(
        f"two-readers-{uuid.uuid4().hex[:8]}",
        broker.bootstrap,
        redis_url,
        str(tmp_path),
        by_position,
    )
    settings = KafkaSettings(scn.bootstrap)
    for kind, n, partitions in (
        ("orders", orders, ORDER_PARTITIONS),
        ("payments", payments, PAYMENT_PARTITIONS),
    ):
        events = [
            {
                "event_id": f"{kind}-{uuid.uuid4().hex}",
                "user": f"u{rng.randrange(USERS)}",
                "ts": BASE_TS + 40 * i,
            }
            for i in range(n)
        ]
        sends = [(e, i % partitions) for i, e in enumerate(events)]
        if not by_position:
            for e in rng.sample(events, n * resent_percent // 100):
                sends.insert(rng.randrange(len(sends) + 1), (e, rng.randrange(partitions)))
        getattr(scn, kind).extend(e for e, _ in sends)
        produce(
            settings,
            scn.topics[kind],
            [(None, json.dumps(e).encode(), None) for e, _ in sends],
            partitions=partitions,
            partitioner=lambda i, _key, sends=sends: sends[i][1],
        )
    return scn


def verify(scn: TwoReaders, redis_client) -> dict[str, int]:
    """Check state, counts topics and order copies against the count made from the input.

    Returns the records each output topic holds, for the test's report.
    """
    settings = KafkaSettings(scn.bootstrap)
    want_orders = scn.counted(scn.orders)
    want_all = scn.counted(scn.orders + scn.payments)
    for node, want in (("orders-per-user", want_orders), ("events-per-user", want_all)):
        stored = node_state(redis_client, scn.name, node)
        state = {codec.decode(k): codec.decode(v) for k, v in stored.items()}
        report = compare_counts(want, state)
        assert report.ok, f"keyed state of {node}: {report}"
    sizes = {}
    for topic, want in (("order-counts", want_orders), ("all-counts", want_all)):
        records = read_topic(settings, scn.topics[topic])
        last: dict[str, int] = defaultdict(int)
        for user, value in _one_value_per_id(records, topic).values():
            last[user.decode()] = max(last[user.decode()], json.loads(value))
        report = compare_counts(want, last)
        assert report.ok, f"last counts in the {topic} topic: {report}"
        sizes[topic] = len(records)
    copies = read_topic(settings, scn.topics["order-copy"])
    values = _one_value_per_id(copies, "order-copy")
    got = Counter(json.loads(v)["event_id"] for _, v in values.values())
    want_copies = (
        Counter(e["event_id"] for e in scn.orders)
        if scn.by_position
        else Counter({e["event_id"]: 1 for e in scn.orders})
    )
    report = compare_counts(want_copies, got)
    assert report.ok, f"order copies: {report}"
    sizes["order-copy"] = len(copies)
    return sizes


def _one_value_per_id(records, topic: str) -> dict[bytes, tuple[bytes, bytes]]:
    """Each record ID's ``(key, value)``; fails on an ID written twice (a copy)."""
    by_id: dict[bytes, list[tuple[bytes, bytes]]] = defaultdict(list)
    for rec in records:
        by_id[rec.headers["onceflow-id"]].append((rec.key, rec.value))
    twice = {rid: v for rid, v in by_id.items() if len(v) > 1}
    assert not twice, f"{len(twice)} record IDs written more than once to the {topic} topic"
    return {rid: v[0] for rid, v in by_id.items()}

"""Getting started (docs/getting-started.md): revenue per country, in PostgreSQL, exactly once.

Orders (a Kafka topic) are joined with their customer's row as it was at the order's time (a
compacted topic of customers: a changelog), summed per country, and upserted into a
PostgreSQL table. With the environment of ``onceflow dev up --with postgres``::

    python examples/shop.py setup      # the two topics and the table
    onceflow run examples/shop.py      # runs until Ctrl-C (or kill -9: it resumes exactly)
    python examples/shop.py feed       # in another terminal: customers, then orders
    python examples/shop.py resend     # every order sent again: totals do not move
    python examples/shop.py move c0 JP # a customer moves: later orders count for JP

Amounts are integer cents (a sum of floats depends on the order it is added in).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import uuid
from typing import Any

from onceflow import DedupConfig, EventTime, KafkaSource, Pipeline
from onceflow.connectors.postgres import PostgresSink

ORDERS, CUSTOMERS, TABLE = "shop.orders", "shop.customers", "revenue_by_country"

# --8<-- [start:pipeline]
pipeline = Pipeline(
    "shop",
    dedup=DedupConfig.of(horizon="24h", bucket="1h"),  # copies within a day are dropped
    event_time=EventTime.of(idle_timeout="2s"),  # a quiet topic stops holding time back
)
orders = pipeline.read(
    "orders",
    KafkaSource(ORDERS, id=lambda o: o["event_id"], timestamp=lambda o: o["ts"]),
)
customers = (
    pipeline.read("customers", KafkaSource(CUSTOMERS, envelope=True, key_codec="utf-8"))
    .key_by("customer-id", lambda r: r["key"])  # the Kafka key, decoded: "c7"
    .map_values("customer", lambda r: r["value"])  # {"name": ..., "country": ...}
)


def country(joined: tuple[str, tuple[dict[str, Any], dict[str, Any] | None]]) -> str:
    """The country of the order's customer at the order's time ('unknown' without a row)."""
    _customer, (_order, row) = joined
    return row["country"] if row else "unknown"


(
    orders.key_by("by-customer", lambda o: o["customer"])
    .join_table("with-customer", customers)  # (customer, (order, customer's row))
    .key_by("by-country", country)
    .map_values("cents", lambda joined: joined[1][0]["cents"])
    .combine_per_key("revenue", "sum")  # (country, running total)
    .map("as-row", lambda kv: {"country": kv[0], "cents": kv[1]})
    .write(
        "db",
        PostgresSink(
            TABLE,
            conninfo=os.environ.get("PG_CONNINFO", ""),  # the password: PGPASSWORD
            mode="upsert",
            key_columns=["country"],
        ),
    )
)
# --8<-- [end:pipeline]

COUNTRIES = ("FR", "DE", "JP", "BR", "US")


def setup() -> None:
    """The topics (one partition each) and the table the sink upserts into."""
    import psycopg
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=_bootstrap())
    topics = [
        NewTopic(ORDERS, 1, 1),
        NewTopic(CUSTOMERS, 1, 1, topic_configs={"cleanup.policy": "compact"}),
    ]
    for topic in topics:
        try:
            admin.create_topics([topic])
        except TopicAlreadyExistsError:
            pass
    admin.close()
    with psycopg.connect(os.environ.get("PG_CONNINFO", ""), autocommit=True) as db:
        db.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (country text PRIMARY KEY, cents bigint)")
    print(f"topics {ORDERS}, {CUSTOMERS} and table {TABLE} are ready")


def feed(n_orders: int, rate: float, seed: int) -> None:
    """The customers not in the topic yet, then ``n_orders`` orders at ``rate`` per second."""
    from kafka import KafkaProducer

    rng = random.Random(seed)
    producer = KafkaProducer(bootstrap_servers=_bootstrap(), acks="all")
    names = [f"c{i}" for i in range(20)]
    known = {key.decode() for _ts, key, _value in read_topic(CUSTOMERS) if key}
    for i, name in enumerate(names):
        if name not in known:  # a moved customer stays where it moved
            _customer(producer, name, COUNTRIES[i % len(COUNTRIES)])
    producer.flush()
    time.sleep(0.5)
    run = uuid.uuid4().hex[:8]  # a second feed sends new orders, not copies
    for i in range(n_orders):
        order = {
            "event_id": f"{run}-{i}",
            "customer": rng.choice(names),
            "cents": rng.randint(100, 10_000),
            "ts": int(time.time() * 1000),
        }
        producer.send(ORDERS, json.dumps(order).encode())
        time.sleep(1 / rate)
    producer.flush()
    print(f"sent {len(set(names) - known)} new customers and {n_orders} orders")


def move(customer: str, country: str) -> None:
    """A customer moves: a new row in the changelog (orders from now on count for ``country``)."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=_bootstrap(), acks="all")
    _customer(producer, customer, country)
    producer.flush()
    print(f"{customer} now lives in {country}")


def resend() -> None:
    """Every order in the topic sent again, as a producer's retry would: copies."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=_bootstrap(), acks="all")
    sent = 0
    for value in read_values(ORDERS):
        producer.send(ORDERS, value)
        sent += 1
    producer.flush()
    print(f"sent {sent} orders again")


def read_values(topic: str) -> list[bytes]:
    """Every value of ``topic``'s one partition, from the start to its end."""
    return [value for _ts, _key, value in read_topic(topic)]


def read_topic(topic: str) -> list[tuple[int, bytes | None, bytes]]:
    """Every record (timestamp, key, value) of ``topic``'s one partition, start to end."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=_bootstrap(), enable_auto_commit=False)
    part = TopicPartition(topic, 0)
    consumer.assign([part])
    end = consumer.end_offsets([part])[part]
    consumer.seek_to_beginning(part)
    out: list[tuple[int, bytes | None, bytes]] = []
    while consumer.position(part) < end:
        for records in consumer.poll(timeout_ms=1000).values():
            out += [(r.timestamp, r.key, r.value) for r in records if r.offset < end]
    consumer.close()
    return out


def _customer(producer: Any, name: str, where: str) -> None:
    row = {"name": name.upper(), "country": where}
    producer.send(CUSTOMERS, key=name.encode(), value=json.dumps(row).encode())


def _bootstrap() -> str:
    return os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "localhost:9092")


def main() -> None:
    """``python examples/shop.py setup|feed|resend|move CUSTOMER COUNTRY``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("setup", "feed", "resend", "move"))
    parser.add_argument("who", nargs="*", help="move: the customer and the new country")
    parser.add_argument("--orders", type=int, default=2000, help="feed: how many orders")
    parser.add_argument("--rate", type=float, default=200.0, help="feed: orders per second")
    parser.add_argument("--seed", type=int, default=7, help="feed: who orders what")
    args = parser.parse_args()
    if args.action == "setup":
        setup()
    elif args.action == "feed":
        feed(args.orders, args.rate, args.seed)
    elif args.action == "move":
        if len(args.who) != 2:
            parser.error("move takes a customer and a country: move c0 JP")
        move(*args.who)
    else:
        resend()


if __name__ == "__main__":
    main()

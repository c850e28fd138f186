"""Nexmark queries on Onceflow: one pipeline per query, events from a Kafka topic to a sink.

``query_pipeline(query, source, sink)`` returns the pipeline; ``onceflow run
examples/nexmark/queries.py`` runs the one ``NEXMARK_QUERY`` names (default ``q1``) from the
topic ``NEXMARK_TOPIC`` to the topic ``NEXMARK_OUT``; with ``NEXMARK_IDS=mixed`` an event's
ID is its ``msg_id`` field where it has one, else its ``onceflow-id`` header (as producers
send them; the torture run's input), instead of its ``event_id``; ``NEXMARK_CHUNK_SIZE`` sets
the records per atomic commit. The plain-Python answer of each query is in ``reference.py``;
the tests compare the two (``tests/examples/test_nexmark.py``).

* q0 pass-through: every event;
* q1 currency conversion: each bid's price in euros (cents, ``price * 908 // 1000``);
* q2 selection: the bids on auctions whose ID is a multiple of 123, as ``(auction, price)``;
* q3 local item suggestion: auctions of category 10 by sellers in OR, ID or CA (a join of
  auctions with the persons table, as of each auction's time);
* q4 average price per category: the running mean of the winning bids of closed auctions
  (their winners found with user state and timers, as in q6);
* q5 hot items: per sliding window (10 s, every 2 s), the auctions with the most bids;
* q7 highest bid: per fixed window of 10 s, the bid with the highest price;
* q6 average selling price by seller: over its last 10 closed auctions (user state and
  timers, see ``q6.py``);
* q8 monitor new users: the persons who joined and created an auction in the same fixed
  window of 10 s (a windowed join of persons and auctions by seller), one row each;
* q11 user sessions: bids per bidder and session (10 s of inactivity ends one);
* q18 deduplication: the last bid (by event time) of each bidder on each auction;
* q20 bids with their auction's details, category 10 only (a join with the auctions table,
  as of each bid's time).

* q12 processing-time windows: bids per bidder in windows of 10 s of processing time (user
  state and a processing-time timer; its rows depend on when the run reads the events, so
  only their totals are checked);
* ``early_bids`` (not a Nexmark query): each bid within 2 s of its auction's start (an
  interval join).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from examples.nexmark.q6 import q6, winning_bids
from onceflow import CoGroup, DedupConfig, EventTime, KafkaSink, KafkaSource, Pipeline, Stream
from onceflow.connectors.base import SinkConnector, SourceConnector
from onceflow.runtime.combine_fn import CombineFn
from onceflow.state import Context, Timer, ValueSpec
from onceflow.windows import Fixed, Sessions, Sliding

OUT_OF_ORDERNESS = "3s"  # the generator's out-of-order events are at most 2 s early


def _bids(events: Stream) -> Stream:
    return events.filter("bids", lambda e: e["type"] == "bid")


def _rank(bid: dict[str, Any], by: str) -> tuple[Any, str]:
    """A total order of bids (ties broken by event ID): the same answer in any order."""
    return (bid[by], bid["event_id"])


class Highest(CombineFn):
    """The bid ranking highest by one field (``price``, ``date_time``)."""

    def __init__(self, by: str) -> None:
        self.by = by

    def create(self) -> Any:
        return None

    def add(self, acc: Any, value: Any) -> Any:
        return value if acc is None or _rank(value, self.by) > _rank(acc, self.by) else acc

    def merge(self, left: Any, right: Any) -> Any:
        return right if left is None else self.add(left, right) if right is not None else left

    @property
    def label(self) -> str:
        return f"highest {self.by}"


class HotAuctions(CombineFn):
    """Bids per auction in one window; the result: ``[most bids, [auctions with that many]]``."""

    def create(self) -> Any:
        return {}

    def add(self, acc: Any, value: Any) -> Any:
        key = str(value)
        acc[key] = acc.get(key, 0) + 1
        return acc

    def merge(self, left: Any, right: Any) -> Any:
        for key, n in right.items():
            left[key] = left.get(key, 0) + n
        return left

    def extract(self, acc: Any) -> Any:
        if not acc:
            return [0, []]
        most = max(acc.values())
        return [most, sorted(int(a) for a, n in acc.items() if n == most)]


def q0(events: Stream) -> Stream:
    return events.map("pass", lambda e: e)


def q1(events: Stream) -> Stream:
    return _bids(events).map(
        "euros",
        lambda b: {
            "auction": b["auction"],
            "bidder": b["bidder"],
            "price": b["price"] * 908 // 1000,
            "date_time": b["date_time"],
        },
    )


def q2(events: Stream) -> Stream:
    return (
        _bids(events)
        .filter("some-auctions", lambda b: b["auction"] % 123 == 0)
        .map("auction-price", lambda b: [b["auction"], b["price"]])
    )


def q4(events: Stream) -> Stream:
    """Average selling price per category: the running mean of closed auctions' winning bids."""
    return (
        winning_bids(events)
        .key_by("by-category", lambda w: w["category"])
        .map_values("price", lambda w: w["price"])
        .combine_per_key("average", "mean")
    )


def q5(events: Stream) -> Stream:
    return (
        _bids(events)
        .key_by("everyone", lambda b: 0)
        .map_values("auction", lambda b: b["auction"])
        .window("sliding", Sliding("10s", "2s"))
        .combine_per_key("hot-items", HotAuctions())
    )


def q7(events: Stream) -> Stream:
    return (
        _bids(events)
        .key_by("everyone", lambda b: 0)
        .window("fixed", Fixed("10s"))
        .combine_per_key("highest-bid", Highest("price"))
    )


def _new_users(kv: tuple[Any, CoGroup]) -> list[dict[str, Any]]:
    _seller, group = kv
    if not group.right:
        return []
    return [{"id": p["id"], "name": p["name"], "start": group.start} for p in group.left]


def q8(events: Stream) -> Stream:
    persons = events.filter("persons", lambda e: e["type"] == "person").key_by(
        "by-id", lambda p: p["id"]
    )
    sellers = events.filter("auctions", lambda e: e["type"] == "auction").key_by(
        "by-seller", lambda a: a["seller"]
    )
    return persons.co_group("joined", sellers, Fixed("10s")).flat_map("new-users", _new_users)


def q11(events: Stream) -> Stream:
    return (
        _bids(events)
        .key_by("by-bidder", lambda b: b["bidder"])
        .map_values("one", lambda b: 1)
        .window("sessions", Sessions("10s"))
        .combine_per_key("bids-per-session", "sum")
    )


BIDS = ValueSpec[int]("bids")
PROCESSING_WINDOW_MS = 10_000


def _count_bid(bidder: int, _bid: dict[str, Any], ctx: Context) -> None:
    """A bid counts in the bidder's current processing-time window (a timer at its end)."""
    bids = ctx.state(BIDS)
    bids.write((bids.read() or 0) + 1)
    if ctx.timers.get() is None:
        end = (ctx.now // PROCESSING_WINDOW_MS + 1) * PROCESSING_WINDOW_MS
        ctx.timers.set_processing_time(end)


def _window_ends(bidder: int, timer: Timer, ctx: Context) -> list[dict[str, Any]]:
    count = ctx.state(BIDS).read() or 0
    ctx.state(BIDS).clear()
    return [{"bidder": bidder, "bids": count, "window_end": timer.time}]


def q12(events: Stream) -> Stream:
    """Bids per bidder in processing-time windows of 10 s (user state, a processing-time timer)."""
    return (
        _bids(events)
        .key_by("by-bidder", lambda b: b["bidder"])
        .process("per-window", _count_bid, states=[BIDS], on_timer=_window_ends)
    )


def _soon(kv: tuple[Any, tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    auction, (a, b) = kv
    return {"auction": auction, "bid": b["event_id"], "after_ms": b["date_time"] - a["date_time"]}


def early_bids(events: Stream) -> Stream:
    """Not a standard query: the bids within 2 s of their auction's start (an interval join)."""
    auctions = events.filter("auctions", lambda e: e["type"] == "auction").key_by(
        "auction-id", lambda a: a["id"]
    )
    bids = _bids(events).key_by("by-auction", lambda b: b["auction"])
    return auctions.interval_join("early", bids, 0, 2).map("row", _soon)


def q18(events: Stream) -> Stream:
    return (
        _bids(events)
        .key_by("bidder-auction", lambda b: f"{b['bidder']}/{b['auction']}")
        .combine_per_key("last-bid", Highest("date_time"))
    )


Q3_STATES = ("OR", "ID", "CA")


def q3(events: Stream) -> Stream:
    """Local item suggestion: auctions of category 10 by sellers in OR, ID or CA."""
    persons = (
        events.filter("persons", lambda e: e["type"] == "person")
        .key_by("person-id", lambda p: p["id"])
        .map_values("where", lambda p: {"name": p["name"], "city": p["city"], "state": p["state"]})
    )
    auctions = events.filter(
        "category-10", lambda e: e["type"] == "auction" and e["category"] == 10
    ).key_by("by-seller", lambda a: a["seller"])
    return (
        auctions.join_table("seller", persons, how="inner")
        .filter("local", lambda kv: kv[1][1]["state"] in Q3_STATES)
        .map("suggest", lambda kv: {"auction": kv[1][0]["id"], **kv[1][1]})
    )


def q20(events: Stream) -> Stream:
    """Bids joined with their auction's details (as of the bid's time), category 10 only."""
    auctions = events.filter("auctions", lambda e: e["type"] == "auction").key_by(
        "auction-id", lambda a: a["id"]
    )
    bids = _bids(events).key_by("by-auction", lambda b: b["auction"])
    return (
        bids.join_table("auction", auctions, how="inner")
        .filter("category-10", lambda kv: kv[1][1]["category"] == 10)
        .map(
            "bid-and-auction",
            lambda kv: {
                "auction": kv[0],
                "bidder": kv[1][0]["bidder"],
                "price": kv[1][0]["price"],
                "date_time": kv[1][0]["date_time"],
                "item_name": kv[1][1]["item_name"],
                "seller": kv[1][1]["seller"],
                "category": kv[1][1]["category"],
            },
        )
    )


QUERIES: dict[str, Callable[[Stream], Stream]] = {
    "early_bids": early_bids,
    "q0": q0,
    "q1": q1,
    "q2": q2,
    "q3": q3,
    "q4": q4,
    "q5": q5,
    "q6": q6,
    "q7": q7,
    "q8": q8,
    "q11": q11,
    "q12": q12,
    "q18": q18,
    "q20": q20,
}


def query_pipeline(
    query: str,
    source: SourceConnector,
    sink: SinkConnector,
    name: str = "",
    dedup: DedupConfig | None = None,
) -> Pipeline:
    """The pipeline of one query: events (IDs from ``event_id``) -> the query -> ``out``."""
    event_time = EventTime.of(out_of_orderness=OUT_OF_ORDERNESS)
    p = Pipeline(name or f"nexmark-{query}", event_time=event_time, dedup=dedup)
    QUERIES[query](p.read("events", source)).write("out", sink)
    return p


def kafka_events(topic: str, **options: Any) -> KafkaSource:
    """The events topic as a source: IDs from ``event_id``, event time from ``date_time``."""
    return KafkaSource(
        topic, id=lambda e: e["event_id"], timestamp=lambda e: e["date_time"], **options
    )


def build() -> Pipeline:
    """For ``onceflow run``: the query ``NEXMARK_QUERY`` from the topic ``NEXMARK_TOPIC``."""
    query = os.environ.get("NEXMARK_QUERY", "q1")
    topic = os.environ.get("NEXMARK_TOPIC", "nexmark-events")
    out = os.environ.get("NEXMARK_OUT", f"nexmark-{query}")
    name = os.environ.get("NEXMARK_PIPELINE", "")
    source = kafka_events(topic)
    if os.environ.get("NEXMARK_IDS") == "mixed":  # as producers send them (the torture run's)
        source = KafkaSource(topic, id=_body_or_header_id, timestamp=lambda e: e["date_time"])
    chunk = os.environ.get("NEXMARK_CHUNK_SIZE")  # records per atomic commit
    dedup = DedupConfig.of(chunk_size=int(chunk)) if chunk else None
    return query_pipeline(query, source, KafkaSink(out), name, dedup)


def _body_or_header_id(event: dict[str, Any]) -> Any:
    """The ``msg_id`` field where an event has one, else (None) its ``onceflow-id`` header."""
    return event.get("msg_id")

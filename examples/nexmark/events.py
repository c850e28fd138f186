"""Nexmark's events: persons, auctions and bids, deterministic by seed, in event time.

Follows the Nexmark specification's shape (Tucker et al., "NEXMark - A Benchmark for Queries
over Data Streams", and the Beam/Flink generators): of every 50 events 1 is a new person, 3
are new auctions and 46 are bids; person and auction IDs count up from 1000; a bid goes to a
"hot" auction (one of a few) with probability 1/2, else to one of the 100 newest auctions, by
a "hot" bidder with probability 1/4, else by one of the 100 newest persons; auctions are in
categories 10..14 and end 1 to 10 seconds of event time after they open.

Event time: one event every ``step_ms`` from ``start_ms``; a fraction ``out_of_order`` of the
events is stamped up to ``max_delay_ms`` earlier than its place in the stream (out of order
but, with an out-of-orderness at least that large, on time). Each event is a flat dict with
its ``type`` (``person``, ``auction``, ``bid``), a unique ``event_id`` and ``date_time`` (ms).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

FIRST_PERSON_ID = 1000
FIRST_AUCTION_ID = 1000
FIRST_CATEGORY_ID = 10
CATEGORIES = 5
PERSON_PROPORTION, AUCTION_PROPORTION, BID_PROPORTION = 1, 3, 46
TOTAL_PROPORTION = PERSON_PROPORTION + AUCTION_PROPORTION + BID_PROPORTION
HOT_AUCTIONS = 4
HOT_BIDDERS = 4
RECENT = 100
CHANNELS = ("Google", "Facebook", "Baidu", "Apple")
CITIES = ("Phoenix", "Los Angeles", "San Francisco", "Boise", "Portland", "Bend", "Redmond")
STATES = ("AZ", "CA", "ID", "OR", "WA", "WY")
NAMES = ("Peter", "Paul", "Luke", "John", "Saul", "Vicky", "Kate", "Julie", "Sarah", "Deiter")


@dataclass(frozen=True)
class Config:
    """How many events, from when, how fast and how out of order."""

    events: int = 10_000
    seed: int = 7
    start_ms: int = 0
    step_ms: int = 10
    out_of_order: float = 0.05
    max_delay_ms: int = 2_000


def generate(config: Config) -> Iterator[dict[str, Any]]:
    """The events in stream order."""
    rng = random.Random(config.seed)
    for i in range(config.events):
        epoch, rem = divmod(i, TOTAL_PROPORTION)
        at = config.start_ms + i * config.step_ms
        if rng.random() < config.out_of_order:
            at -= rng.randrange(1, config.max_delay_ms + 1)
        persons = epoch * PERSON_PROPORTION + min(rem, PERSON_PROPORTION)
        auctions = epoch * AUCTION_PROPORTION + max(0, min(rem - PERSON_PROPORTION, 3))
        if rem < PERSON_PROPORTION:
            event = _person(rng, FIRST_PERSON_ID + persons - 1)
        elif rem < PERSON_PROPORTION + AUCTION_PROPORTION:
            event = _auction(rng, FIRST_AUCTION_ID + auctions - 1, persons, at)
        else:
            event = _bid(rng, auctions, persons)
        yield {"event_id": f"n{config.seed}-{i}", "date_time": at, **event}


def _person(rng: random.Random, pid: int) -> dict[str, Any]:
    return {
        "type": "person",
        "id": pid,
        "name": f"{rng.choice(NAMES)} {rng.choice(NAMES)}",
        "email_address": f"p{pid}@example.com",
        "credit_card": " ".join(f"{rng.randrange(10_000):04d}" for _ in range(4)),
        "city": rng.choice(CITIES),
        "state": rng.choice(STATES),
    }


def _auction(rng: random.Random, aid: int, persons: int, at: int) -> dict[str, Any]:
    initial = rng.randrange(1, 1_000)
    return {
        "type": "auction",
        "id": aid,
        "item_name": f"item-{aid}",
        "initial_bid": initial,
        "reserve": initial + rng.randrange(1, 1_000),
        "expires": at + rng.randrange(1_000, 10_001),
        "seller": _recent(rng, FIRST_PERSON_ID, max(persons, 1), HOT_BIDDERS, 0.25),
        "category": FIRST_CATEGORY_ID + rng.randrange(CATEGORIES),
    }


def _bid(rng: random.Random, auctions: int, persons: int) -> dict[str, Any]:
    return {
        "type": "bid",
        "auction": _recent(rng, FIRST_AUCTION_ID, max(auctions, 1), HOT_AUCTIONS, 0.5),
        "bidder": _recent(rng, FIRST_PERSON_ID, max(persons, 1), HOT_BIDDERS, 0.25),
        "price": rng.randrange(100, 100_000),  # cents
        "channel": rng.choice(CHANNELS),
    }


def _recent(rng: random.Random, first: int, count: int, hot: int, hot_share: float) -> int:
    """One of the ``hot`` first IDs with probability ``hot_share``, else a recent one."""
    if rng.random() < hot_share:
        return first + rng.randrange(min(hot, count))
    return first + count - 1 - rng.randrange(min(RECENT, count))


def to_kafka(settings: Any, topic: str, config: Config, partitions: int = 4) -> int:
    """Write the events to a Kafka topic (JSON values); how many."""
    from onceflow.connectors.kafka.topics import produce

    records = ((None, json.dumps(e).encode(), None) for e in generate(config))
    return produce(settings, topic, records, partitions=partitions)

"""The Nexmark queries (examples/nexmark) against their plain-Python reference.

The same generated events (out of order, within the pipelines' out-of-orderness) go through
each query with ``run_test`` in micro-batches of 500, then the watermark passes the end: the
outputs must be the reference's, window by window and key by key.
"""

from __future__ import annotations

import time

import pytest

from examples.nexmark import reference
from examples.nexmark.events import Config, generate
from examples.nexmark.queries import kafka_events, query_pipeline
from onceflow.connectors.collect import Collect
from onceflow.testing import TestStream, run_test

# Recent event times (an hour ago, on a 10 s boundary): windows fire as in production.
START = (int(time.time() * 1000) - 3_600_000) // 10_000 * 10_000
EVENTS = list(generate(Config(events=3_000, seed=11, start_ms=START)))


def _run(query: str) -> list:
    stream = TestStream()
    for i in range(0, len(EVENTS), 500):
        stream = stream.add(EVENTS[i : i + 500])
    stream = stream.advance_watermark_to_end()
    pipeline = query_pipeline(query, kafka_events("unused"), Collect(), f"nexmark-{query}")
    out = run_test(pipeline, {"events": stream})
    assert out.dead_letters == [], out.dead_letters[:3]
    return list(out["out"])


def test_the_generator_is_deterministic_and_shaped_as_nexmark():
    again = list(generate(Config(events=3_000, seed=11, start_ms=START)))
    assert again == EVENTS
    kinds = [e["type"] for e in EVENTS]
    assert (kinds.count("person"), kinds.count("auction"), kinds.count("bid")) == (60, 180, 2760)
    late = sum(
        1 for a, b in zip(EVENTS, EVENTS[1:], strict=False) if b["date_time"] < a["date_time"]
    )
    assert late > 50, "some events are out of order"


@pytest.mark.parametrize("query", ["q0", "q1", "q2", "q3", "q8", "q20", "early_bids"])
def test_element_wise_queries(query):
    got = _run(query)
    want = getattr(reference, query)(EVENTS)
    assert want, "the reference has rows to compare"
    key = repr
    assert sorted(got, key=key) == sorted(want, key=key)


def test_q5_hot_items():
    got = {(p.start, p.end): p.value for _key, p in _run("q5") if p.final}
    assert got == reference.q5(EVENTS)


def test_q6_average_price_per_seller_over_its_last_closed_auctions():
    got = _run("q6")
    want = reference.q6(EVENTS)
    assert len(want) > 50
    key = repr
    assert sorted(got, key=key) == sorted(want, key=key)


def test_q7_highest_bid():
    got = {(p.start, p.end): p.value for _key, p in _run("q7") if p.final}
    assert got == reference.q7(EVENTS)


def test_q11_user_sessions():
    got = {(bidder, p.start, p.end): p.value for bidder, p in _run("q11") if p.final}
    assert got == reference.q11(EVENTS)


def test_q18_last_bid_per_bidder_and_auction():
    last = {}
    for key, bid in _run("q18"):
        last[key] = bid
    assert last == reference.q18(EVENTS)


def test_q4_average_price_per_category():
    last = {}
    for category, average in _run("q4"):  # running means: the last one is over every auction
        last[category] = average
    want = reference.q4(EVENTS)
    assert want and last.keys() == want.keys()
    assert all(abs(last[c] - want[c]) < 1e-6 for c in want)


def test_q12_processing_time_windows_add_up_to_every_bid():
    stream = TestStream()
    for i in range(0, len(EVENTS), 500):  # ten seconds of processing time between batches
        stream = stream.add(EVENTS[i : i + 500]).advance_processing_time(10)
    stream = stream.advance_processing_time(10).advance_watermark_to_end()
    pipeline = query_pipeline("q12", kafka_events("unused"), Collect(), "nexmark-q12")
    out = run_test(pipeline, {"events": stream})
    assert out.dead_letters == []
    rows = list(out["out"])
    totals: dict[int, int] = {}
    for row in rows:
        totals[row["bidder"]] = totals.get(row["bidder"], 0) + row["bids"]
    assert totals == reference.q12_totals(EVENTS)
    ends = {row["window_end"] for row in rows}
    assert len(ends) > 3 and all(end % 10_000 == 0 for end in ends), "several windows"

"""The testing tutorial's code (docs/testing.md shows it from here, so it cannot rot).

Each ``--8<--`` section is a piece the tutorial includes; the tests are what a user would
write next to their pipeline file (``from orders import pipeline`` in their project).
"""

from __future__ import annotations

import pytest

# --8<-- [start:imports]
from examples.clicks_per_user import pipeline as clicks  # yours: from clicks import pipeline
from examples.orders import pipeline as orders  # your project: from orders import pipeline
from onceflow.testing import TestStream, assert_that, run_test
from onceflow.windows import Pane

# --8<-- [end:imports]


# --8<-- [start:orders]
def order(order_id, customer, amount, status="paid"):
    return {
        "event_id": f"e{order_id}",
        "order_id": order_id,
        "customer": customer,
        "amount": amount,
        "status": status,
        "ts": 1_000,
    }


def test_revenue_per_customer():
    out = run_test(
        orders, {"orders": [order(1, "c1", 10), order(2, "c1", 5), order(3, "c2", 7, "new")]}
    )
    assert_that(out["revenue-out"]).contains_exactly([("c1", 15), ("c2", 7)])
    assert_that(out["paid-out"]).contains_exactly([order(1, "c1", 10), order(2, "c1", 5)])


def test_an_order_sent_twice_counts_once():
    out = run_test(orders, {"orders": [order(1, "c1", 10), order(1, "c1", 10)]})
    assert_that(out["revenue-out"]).contains_exactly([("c1", 10)])
    assert out.result.counter("duplicates_dropped") == 1


def test_an_order_without_customer_is_a_dead_letter():
    no_customer = {"event_id": "e9", "order_id": 9, "amount": 1, "status": "paid", "ts": 1_000}
    out = run_test(orders, {"orders": [order(1, "c1", 10), no_customer]})
    assert_that(out["revenue-out"]).contains_exactly([("c1", 10)])
    assert_that(out.dead_letters).map(lambda d: (d["stage"], d["code"])).contains_exactly(
        [("by-customer", "user_error")]
    )
    # --8<-- [end:orders]


# --8<-- [start:stream]
def click(n, user, ts):
    return {"click_id": n, "user": user, "ts": ts}


def clicks_stream():
    # The pipeline: 1-minute windows, an early pane every 3 clicks, 30 s of allowed
    # lateness, 5 s of out-of-orderness. Each step is one micro-batch.
    return (
        TestStream()
        .add([click(1, "ann", 10_000), click(2, "ann", 20_000), click(3, "bob", 30_000)])
        .add([click(4, "ann", 50_000)])  # ann's 3rd click of the minute: an early pane
        .advance_watermark(70_000)  # the watermark passes 60 s (70 s - 5 s): on-time panes
        .add([click(5, "ann", 55_000), click(6, "ann", 65_000)])  # 55 s: late but allowed
        .advance_watermark(100_000)  # 95 s: past 60 s + 30 s of lateness, the minute closes
        .add([click(7, "bob", 40_000)])  # too late for a closed window: a dead letter
    )
    # --8<-- [end:stream]


# --8<-- [start:panes]
def test_clicks_per_minute():
    out = run_test(clicks, {"clicks": clicks_stream()})
    panes = assert_that(out["per-minute"])
    panes.for_key("ann").in_window(0, 60_000).has_timings(["early", "on_time", "late", "late"])
    panes.for_key("ann").in_window(0, 60_000).values().contains_in_order(
        [("ann", 3), ("ann", 3), ("ann", 4), ("ann", 4)]
    )
    panes.for_key("bob").contains_exactly(
        [
            ("bob", Pane(1, 0, 60_000, "on_time", 0, False)),
            ("bob", Pane(1, 0, 60_000, "late", 1, True)),
        ]
    )
    panes.has_final_results({("ann", 0, 60_000): 4, ("bob", 0, 60_000): 1})
    panes.in_window(60_000, 120_000).is_empty()  # ann's second minute is still open
    assert_that(out.dead_letters).map(lambda d: (d["code"], d["ts"])).contains_exactly(
        [("window_closed", 40_000)]
    )
    # --8<-- [end:panes]


def test_a_failed_assertion_says_what_differs():
    out = run_test(orders, {"orders": [order(1, "c1", 10), order(2, "c2", 5)]})
    with pytest.raises(AssertionError) as err:
        # --8<-- [start:failure]
        assert_that(out["revenue-out"], label="revenue-out").contains_exactly(
            [("c1", 10), ("c2", 7)]
        )
        # --8<-- [end:failure]
    assert str(err.value).splitlines()[:3] == [
        "revenue-out: contains_exactly failed",
        "  missing (1, expected but not found): [('c2', 7)]",
        "  unexpected (1, found but not expected): [('c2', 5)]",
    ]


@pytest.mark.spark
@pytest.mark.redis
def test_clicks_per_minute_on_spark(spark):
    # --8<-- [start:spark]
    out = run_test(clicks, {"clicks": clicks_stream()}, mode="spark")
    assert_that(out["per-minute"]).has_final_results({("ann", 0, 60_000): 4, ("bob", 0, 60_000): 1})
    # --8<-- [end:spark]

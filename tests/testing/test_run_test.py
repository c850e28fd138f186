"""``run_test`` in process: users' Kafka pipelines on test streams, no JVM, no Redis, no Kafka.

Expected values are worked out by hand from the rules the docs state (one micro-batch per
step; a watermark advance takes effect from the next batch; windows fire when the watermark
passes their end and close at end + allowed lateness).
"""

from __future__ import annotations

import pytest

from onceflow.connectors.kafka import KafkaSink, KafkaSource
from onceflow.kernel.eventtime import EventTime
from onceflow.kernel.windows import Fixed, Pane, Sessions, Sliding, Trigger
from onceflow.pipeline import Pipeline, sinks, sources
from onceflow.runtime.errors import RunError
from onceflow.testing import TestInputError, TestStream, assert_that, run_test

START = 1_700_000_000_000  # the in-process batch clock, for processing-time cases


def orders_pipeline():
    """README's example: paid orders out, revenue per customer."""
    p = Pipeline("orders")
    orders = p.read(
        "orders",
        KafkaSource("orders", id=lambda o: o["event_id"], timestamp=lambda o: o["ts"]),
    )
    orders.filter("paid", lambda o: o["status"] == "paid").write("paid-out", KafkaSink("paid"))
    (
        orders.key_by("by-customer", lambda o: o["customer"])
        .map_values("amount", lambda o: o["amount"])
        .combine_per_key("revenue", "sum")
        .write("revenue-out", KafkaSink("revenue"))
    )
    return p


def order(n, customer, amount, status="paid", ts=1_000):
    return {
        "event_id": f"e{n}",
        "order_id": n,
        "customer": customer,
        "amount": amount,
        "status": status,
        "ts": ts,
    }


def windowed(window, **options):
    """Per-key sums of ``(key, value, ts)`` tuples over ``window``."""
    p = Pipeline("win", event_time=options.pop("event_time", None))
    (
        p.read("in", KafkaSource("in", timestamp=lambda e: e[2]))
        .key_by("key", lambda e: e[0])
        .map_values("value", lambda e: e[1])
        .window("window", window, **options)
        .combine_per_key("sum", "sum")
        .write("out", KafkaSink("out"))
    )
    return p


def test_a_list_is_one_batch_and_copies_with_the_same_id_are_dropped():
    inputs = [order(1, "c1", 5), order(2, "c2", 7, "new"), order(1, "c1", 5), order(3, "c1", 1)]
    out = run_test(orders_pipeline(), {"orders": inputs})
    assert_that(out["paid-out"]).contains_exactly([order(1, "c1", 5), order(3, "c1", 1)])
    assert_that(out["revenue-out"]).contains_exactly([("c1", 6), ("c2", 7)])
    assert out.result.counter("duplicates_dropped") == 1
    assert out.dead_letters == []


def test_unwindowed_state_is_updated_per_batch_for_the_keys_that_changed():
    stream = (
        TestStream()
        .add([order(1, "c1", 5), order(2, "c2", 7)])
        .add([order(3, "c1", 10)])
        .add([order(2, "c2", 7)])  # a copy: no change, no output
    )
    out = run_test(orders_pipeline(), {"orders": stream})
    assert_that(out["revenue-out"]).contains_in_order([("c1", 5), ("c2", 7), ("c1", 15)])


def test_element_wise_transforms_and_user_errors_become_dead_letters():
    p = Pipeline("words")
    (
        p.read("lines", KafkaSource("lines", codec="utf-8"))
        .flat_map("split", str.split)
        .map("length", lambda w: 10 // (len(w) - 3))
        .filter("positive", lambda n: n > 0)
        .write("out", KafkaSink("out"))
    )
    out = run_test(p, {"lines": ["a quick brown fox", "jumps"]})
    # 10 // (len - 3): a -> -5, quick -> 5, brown -> 5, fox -> ZeroDivisionError, jumps -> 5
    assert_that(out["out"]).contains_exactly([5, 5, 5])
    [letter] = out.dead_letters
    assert letter["stage"] == "length"
    assert letter["code"] == "user_error"
    assert letter["error"].startswith("ZeroDivisionError")
    assert letter["value"] == '"fox"'


def test_on_error_fail_stops_the_run_naming_stage_and_record():
    p = Pipeline("strict", on_error="fail")
    p.read("in", KafkaSource("in")).map("invert", lambda x: 1 / x).write("out", KafkaSink("o"))
    with pytest.raises(RunError, match=r"stage 'in'.*ZeroDivisionError.*teststream-in:0@1"):
        run_test(p, {"in": [1, 0, 2]})


def test_watermark_fires_on_time_panes_and_later_records_are_dead_letters():
    stream = (
        TestStream()
        .add([("a", 1, 1_000), ("b", 2, 59_000), ("a", 3, 61_000)])
        .advance_watermark(60_000)
        .add([("a", 4, 30_000)])  # its window [0, 60 s) closed: a dead letter
    )
    out = run_test(windowed(Fixed(60)), {"in": stream})
    assert_that(out["out"]).contains_exactly(
        [
            ("a", Pane(1, 0, 60_000, "on_time", 0, True)),
            ("b", Pane(2, 0, 60_000, "on_time", 0, True)),
        ]
    )
    [letter] = out.dead_letters
    assert (letter["code"], letter["ts"]) == ("window_closed", 30_000)
    assert "allowed lateness 0 ms" in letter["error"]
    # batch 0 at watermark 0, the advance's batch still at 61 s, then 60 s (max, never back)
    assert out.watermarks[:2] == [0, 61_000]


def test_early_on_time_late_and_final_panes_of_one_window():
    stream = (
        TestStream()
        .add([("a", 1, 1_000), ("a", 2, 2_000), ("a", 3, 3_000)])  # 3 >= 2: an early pane
        .advance_watermark(10_000)  # the next batch passes the end: on time
        .add([("a", 4, 4_000)])  # within the allowed lateness: a late pane
        .advance_watermark(15_000)  # end + lateness: the window closes, final pane
        .add([("a", 5, 5_000)])  # too late: dead letter
    )
    p = windowed(Fixed(10), trigger=Trigger(early_every=2), allowed_lateness=5)
    out = run_test(p, {"in": stream})
    panes = assert_that(out["out"], label="out")
    panes.for_key("a").in_window(0, 10_000).has_timings(["early", "on_time", "late", "late"])
    panes.values().contains_in_order([("a", 6), ("a", 6), ("a", 10), ("a", 10)])
    panes.has_final_results({("a", 0, 10_000): 10})
    assert [d["code"] for d in out.dead_letters] == ["window_closed"]


def test_processing_time_triggers_follow_the_test_clock():
    stream = (
        TestStream()
        .add([("a", 1, 1_000)])
        .advance_processing_time(10)  # 10 s since the pane's first record: not yet
        .add([("a", 2, 2_000)])
        .advance_processing_time("25s")  # 35 s: the early pane is due
    )
    p = windowed(Fixed(10), trigger=Trigger(early_seconds=30))
    out = run_test(p, {"in": stream}, start_time_ms=START)
    assert_that(out["out"]).contains_exactly([("a", Pane(3, 0, 10_000, "early", 0, False))])


def test_sliding_windows_take_each_record_in_every_window_it_falls_in():
    out = run_test(windowed(Sliding(10, 5)), {"in": [("a", 1, 7_000), ("a", 10, 12_000)]})
    assert_that(out["out"]).final().values().contains_exactly([("a", 1), ("a", 11), ("a", 10)])
    assert_that(out["out"]).in_window(5_000, 15_000).values().contains_exactly([("a", 11)])


def test_sessions_merge_and_discarding_panes_carry_what_is_new():
    stream = (
        TestStream()
        .add([("a", 1, 1_000), ("a", 2, 4_000), ("b", 1, 1_000)])
        .advance_watermark(9_500)  # both sessions pass their end: on-time panes
        .add([("a", 10, 7_000)])  # late but allowed: a's session grows to [1 s, 12 s)
        .advance_watermark_to_end()
    )
    p = windowed(Sessions(5), accumulation="discarding", allowed_lateness=10)
    out = run_test(p, {"in": stream})
    assert_that(out["out"]).contains_exactly(
        [
            ("a", Pane(3, 1_000, 9_000, "on_time", 0, False)),
            ("b", Pane(1, 1_000, 6_000, "on_time", 0, False)),
            # the merged session is a new window: its panes count from 0 again
            ("a", Pane(10, 1_000, 12_000, "on_time", 0, True)),
            ("b", Pane(0, 1_000, 6_000, "late", 1, True)),
        ]
    )


def test_out_of_orderness_holds_the_watermark_back():
    stream = TestStream().add([("a", 1, 1_000), ("a", 2, 12_000)]).add([("a", 3, 5_000)])
    p = windowed(Fixed(10), event_time=EventTime.of(out_of_orderness="5s"))
    out = run_test(p, {"in": stream})
    # after 12 s the watermark is 7 s: the record at 5 s is on time; nothing has closed yet
    assert out.dead_letters == []
    assert out.watermarks == [0, 7_000]
    assert_that(out["out"]).is_empty()


def test_a_collection_source_needs_no_input_and_matches_the_bounded_result():
    p = Pipeline("bounded")
    (
        p.read(
            "s", sources.Collection([("a", 1, 1_000), ("a", 2, 61_000)], timestamp=lambda e: e[2])
        )
        .key_by("k", lambda e: e[0])
        .map_values("v", lambda e: e[1])
        .window("w", 60)
        .combine_per_key("n", "count")
        .write("o", sinks.Collect())
    )
    out = run_test(p)
    assert_that(out["o"]).contains_exactly(
        [
            ("a", Pane(1, 0, 60_000, "on_time", 0, True)),
            ("a", Pane(1, 60_000, 120_000, "on_time", 0, True)),
        ]
    )


def test_missing_and_unknown_inputs_are_refused_with_the_source_names():
    with pytest.raises(
        TestInputError, match=r"source stage 'orders' \(kafka orders.*inputs=\{'orders'"
    ):
        run_test(orders_pipeline())
    with pytest.raises(TestInputError, match=r"'order', which are not source stages.*'orders'"):
        run_test(orders_pipeline(), {"order": []})
    with pytest.raises(TestInputError, match="got a single dict; wrap it in a list"):
        run_test(orders_pipeline(), {"orders": order(1, "c1", 5)})


def test_unknown_sink_names_list_the_sinks():
    out = run_test(orders_pipeline(), {"orders": []})
    with pytest.raises(KeyError, match="sink stages are: 'paid-out', 'revenue-out'"):
        out["revenue"]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: TestStream().add({"a": 1}), "wrap it in a list"),
        (lambda: TestStream().add([1], at=1.5), "at must be an int of milliseconds"),
        (lambda: TestStream().advance_processing_time(0), "needs a positive duration"),
        (lambda: TestStream().add([object()]), "cannot be encoded"),
    ],
)
def test_test_stream_refuses_bad_steps(build, message):
    with pytest.raises(TestInputError, match=message):
        build()


def test_the_unoptimized_plan_gives_the_same_outputs():
    stream = (
        TestStream()
        .add([("a", 1, 1_000), ("b", 2, 59_000), ("a", 3, 61_000)])
        .advance_watermark(60_000)
        .add([("a", 4, 62_000), ("b", 1, 30_000)])
        # not to the end: unfused, the panes cross one more boundary, where a watermark more
        # than the dedup horizon past their event time would make them late
        .advance_watermark(200_000)
    )
    p = windowed(Fixed(60), trigger=Trigger(early_every=2))
    fused = run_test(p, {"in": stream})
    unfused = run_test(p, {"in": stream}, rules=())
    assert len(p.plan().stages) < len(p.plan(()).stages)
    assert fused["out"]
    assert_that(unfused["out"]).contains_exactly(fused["out"])
    assert_that(unfused.dead_letters).map(lambda d: (d["code"], d["ts"])).contains_exactly(
        [(d["code"], d["ts"]) for d in fused.dead_letters]
    )


def test_panes_crossing_a_boundary_after_a_jump_past_the_horizon_are_late():
    """The runtime's rule, kept by the evaluator: see the tutorial's note on synthetic times."""
    p = windowed(Fixed(60))
    stream = TestStream().add([("a", 1, 1_000)]).advance_watermark_to_end()
    out = run_test(p, {"in": stream}, rules=(), start_time_ms=START)
    assert_that(out["out"]).is_empty()
    assert_that(out.dead_letters).map(lambda d: (d["stage"], d["code"], d["ts"])).contains_exactly(
        [("out", "late", 59_999)]
    )

"""The in-process evaluator against the real thing: the same test streams through both.

``mode="spark"`` runs each pipeline as an exactly-once streaming query on local Spark with
a real Redis (heartbeats and clock steps through Onceflow's own lanes and batch clock, ticks
through the streaming run's ``Ticker``); ``mode="memory"`` runs it in process. Every sink
must receive the same elements (panes included: window, timing, index, final, value), the
dead letters must be the same, and both must take the same number of micro-batches.
"""

from __future__ import annotations

import pytest

from onceflow.connectors.kafka import KafkaSink, KafkaSource
from onceflow.kernel.eventtime import EventTime
from onceflow.kernel.windows import Fixed, Sessions, Sliding, Trigger
from onceflow.pipeline import Pipeline, sinks, sources
from onceflow.testing import TestStream, assert_that, run_test

pytestmark = [pytest.mark.spark, pytest.mark.redis]


def element_wise():
    """Filter, flat_map, map with a failing record, fan-out, dedup by ID, a running sum."""
    p = Pipeline("eq-elementwise")
    orders = p.read(
        "orders", KafkaSource("orders", id=lambda o: o["id"], timestamp=lambda o: o["ts"])
    )
    orders.filter("paid", lambda o: o["paid"]).write("paid-out", KafkaSink("paid"))
    (
        orders.flat_map("items", lambda o: [(o["who"], n) for n in o["items"]])
        .map("per-item", lambda kv: (kv[0], 12 // kv[1]))
        .key_by("by-who", lambda kv: kv[0])
        .map_values("amount", lambda kv: kv[1])
        .combine_per_key("total", "sum")
        .write("total-out", KafkaSink("totals"))
    )
    return p


def element_wise_input():
    def o(i, who, items, paid=True):
        return {"id": i, "who": who, "items": items, "paid": paid, "ts": 1_000 * i}

    return (
        TestStream()
        .add([o(1, "ann", [1, 2]), o(2, "bob", [3], paid=False), o(1, "ann", [1, 2])])
        .add([o(3, "ann", [0, 4]), o(4, "cy", [6])])  # 12 // 0: a dead letter
        .add([o(2, "bob", [3]), o(5, "bob", [12])])  # order 2 again: a copy
    )


def fixed_and_sliding():
    """Two windowed combines of one keyed stream: early/late panes, lateness, sliding."""
    p = Pipeline("eq-windows")
    keyed = (
        p.read("events", KafkaSource("events", timestamp=lambda e: e[2]))
        .key_by("key", lambda e: e[0])
        .map_values("value", lambda e: e[1])
    )
    (
        keyed.window("fixed", Fixed(10), trigger=Trigger(early_every=2), allowed_lateness=5)
        .combine_per_key("fixed-sum", "sum")
        .write("fixed-out", KafkaSink("fixed"))
    )
    (
        keyed.window("sliding", Sliding(10, 5))
        .combine_per_key("sliding-count", "count")
        .write("sliding-out", KafkaSink("sliding"))
    )
    return p


def windows_input():
    return (
        TestStream()
        .add([("a", 1, 1_000), ("a", 2, 2_000), ("b", 5, 8_000), ("a", 3, 13_000)])
        .advance_watermark(10_000)
        .add([("a", 4, 4_000), ("b", 1, 12_000)])  # 4 s: late, within the lateness
        .advance_watermark(16_000)
        .add([("a", 9, 3_000), ("b", 2, 17_000)])  # 3 s: its windows have closed
        .advance_watermark_to_end()
    )


def sessions():
    p = Pipeline("eq-sessions")
    (
        p.read("clicks", KafkaSource("clicks", timestamp=lambda e: e[1]))
        .key_by("user", lambda e: e[0])
        .map_values("one", lambda e: 1)
        .window("session", Sessions(5), accumulation="discarding", allowed_lateness=10)
        .combine_per_key("clicks-per-session", "sum")
        .write("sessions-out", KafkaSink("sessions"))
    )
    return p


def sessions_input():
    return (
        TestStream()
        .add([("u1", 1_000), ("u1", 4_000), ("u2", 1_000)])  # two sessions of u1 merge
        .advance_watermark(9_500)  # both sessions pass their end: on-time panes
        .add([("u1", 7_000), ("u2", 3_000), ("u2", 20_000)])  # late but allowed: they grow
        .advance_watermark(40_000)
        .add([("u1", 2_000)])  # its session has closed
        .advance_watermark_to_end()
    )


def merged_streams():
    """Two sources merged into one windowed count (each stream is its own lane)."""
    p = Pipeline("eq-merge", event_time=EventTime.of(idle_timeout="1h"))
    left = p.read("left", KafkaSource("left", timestamp=lambda e: e[1]))
    right = p.read("right", KafkaSource("right", timestamp=lambda e: e[1]))
    (
        p.merge("both", left, right)
        .key_by("key", lambda e: e[0])
        .window("minute", Fixed(60))
        .count_per_key("count")
        .write("count-out", KafkaSink("counts"))
    )
    return p


def merged_input():
    left = (
        TestStream()
        .add([("x", 1_000), ("y", 5_000)])
        .advance_watermark(70_000)
        .add([("x", 65_000)])
        .advance_watermark_to_end()
    )
    right = TestStream().add([("x", 2_000)]).add([("y", 61_000)]).advance_watermark(130_000)
    return {"left": left, "right": right}


def processing_time():
    """Early panes by processing time: clock steps move the batch clock on both sides."""
    p = Pipeline("eq-processing-time")
    (
        p.read("events", KafkaSource("events", timestamp=lambda e: e[2]))
        .key_by("key", lambda e: e[0])
        .map_values("value", lambda e: e[1])
        # far longer than a Spark run takes, so that only the clock steps can make it due
        .window("minute", Fixed(60), trigger=Trigger(early_seconds=300))
        .combine_per_key("sum", "sum")
        .write("sum-out", KafkaSink("sums"))
    )
    return p


def processing_time_input():
    return (
        TestStream()
        .add([("a", 1, 1_000), ("b", 2, 2_000)])
        .advance_processing_time("400s")  # early panes for a and b
        .add([("a", 3, 3_000)])
        .advance_processing_time(100)  # not yet: 100 s since a's new record
        .advance_watermark_to_end()
    )


def cascaded_windows():
    """Per-10 s counts summed per minute: each minute's last pane lands in a window that fires
    in the batch that made it (the watermark of the batch before decides what has closed)."""
    p = Pipeline("eq-cascade")
    (
        p.read("events", KafkaSource("events", timestamp=lambda e: e[1]))
        .key_by("key", lambda e: e[0])
        .window("ten-s", Fixed(10))
        .count_per_key("count")
        .key_by("again", lambda kv: kv[0])
        .map_values("n", lambda kv: kv[1].value)
        .window("minute", Fixed(60))
        .combine_per_key("sum", "sum")
        .write("sum-out", KafkaSink("sums"))
    )
    return p


def cascaded_input():
    return (
        TestStream()
        .add([("a", 1_000), ("a", 55_000), ("b", 58_000)])
        .add([("a", 61_000), ("b", 119_000)])
        .advance_watermark(185_000)  # (to the end would be past the horizon: panes late)
    )


CASES = {
    "window-after-window": (cascaded_windows, lambda: {"events": cascaded_input()}),
    "element-wise": (element_wise, lambda: {"orders": element_wise_input()}),
    "fixed-and-sliding-late-data": (fixed_and_sliding, lambda: {"events": windows_input()}),
    "sessions-late-data-discarding": (sessions, lambda: {"clicks": sessions_input()}),
    "two-streams-merged": (merged_streams, merged_input),
    "processing-time-early-panes": (processing_time, lambda: {"events": processing_time_input()}),
}


def letters(out):
    """Dead letters without where they ran (partition numbers differ by design)."""
    return [(d["stage"], d["code"], d["ts"], d.get("value"), d["error"]) for d in out.dead_letters]


@pytest.mark.parametrize("case", list(CASES))
def test_evaluator_and_spark_give_the_same_outputs(case, spark, redis_server):
    build, inputs = CASES[case]
    memory = run_test(build(), inputs())
    real = run_test(build(), inputs(), mode="spark", session=spark, redis_url=redis_server.url)
    left = list(redis_server.client().scan_iter(match=f"of:{{{build().name}-test-*"))
    assert not left, "the test run's namespace stays in a Redis that is not its own"
    assert any(memory[sink] for sink in memory), "a case that produces nothing proves nothing"
    for sink in memory:
        assert_that(real[sink], label=f"{sink} on Spark").contains_exactly(memory[sink])
    assert_that(letters(real), label="dead letters on Spark").contains_exactly(letters(memory))
    assert real.result.batches == memory.result.batches
    if case == "window-after-window":  # and both agree with a plain count
        sums = sorted((k, pane.start, pane.value) for k, pane in real["sum-out"] if pane.final)
        assert sums == [
            ("a", 0, 2),
            ("a", 60_000, 1),
            ("b", 0, 1),
            ("b", 60_000, 1),
        ]


EVENTS = [("a", 3, 1_000), ("b", 1, 4_000), ("a", 2, 9_000), ("a", 5, 12_000), ("b", 7, 31_000)]


@pytest.mark.parametrize(
    "window", [Fixed(10), Sliding(10, 5), Sessions(5)], ids=["fixed", "sliding", "sessions"]
)
def test_a_bounded_run_and_the_evaluator_fire_the_same_final_panes(window, spark, tmp_path):
    """A list input ends with the watermark at the end: every window's one final pane."""
    out = sinks.Collect()
    p = Pipeline("eq-bounded")
    (
        p.read("s", sources.Collection(EVENTS, timestamp=lambda e: e[2]))
        .key_by("k", lambda e: e[0])
        .map_values("v", lambda e: e[1])
        .window("w", window)
        .combine_per_key("sum", "sum")
        .write("o", out)
    )
    p.run(session=spark, progress=False, output_dir=str(tmp_path))
    memory = run_test(p)
    assert out.results
    assert_that(out.results, label="bounded Spark run").contains_exactly(memory["o"])

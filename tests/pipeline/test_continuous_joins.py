"""Interval joins and joins with a table's versions, against plain-Python references."""

from __future__ import annotations

import random
import time

from onceflow import Pipeline, sources
from onceflow.testing import TestStream, run_test

START = (int(time.time() * 1000) - 3_600_000) // 10_000 * 10_000


def _interval_pipeline(lower, upper) -> Pipeline:
    p = Pipeline("interval")
    a = p.read("a", sources.Collection([])).key_by("ka", lambda e: e["k"])
    b = p.read("b", sources.Collection([])).key_by("kb", lambda e: e["k"])
    a = a.map_values("a-id", lambda e: e["id"])
    b = b.map_values("b-id", lambda e: e["id"])
    a.interval_join("pairs", b, lower, upper).write("out", sources_sink())
    return p


def sources_sink():
    from onceflow import sinks

    return sinks.Collect()


def test_an_interval_join_gives_each_close_pair_once_and_refuses_what_is_late():
    rng = random.Random(4)
    a = [
        {"id": f"a{i}", "k": f"k{rng.randrange(5)}", "t": START + rng.randrange(60_000)}
        for i in range(120)
    ]
    b = [
        {"id": f"b{i}", "k": f"k{rng.randrange(5)}", "t": START + rng.randrange(60_000)}
        for i in range(120)
    ]
    lower, upper = -2_000, 3_000
    want = sorted(
        (x["k"], (x["id"], y["id"]))
        for x in a
        for y in b
        if x["k"] == y["k"] and x["t"] + lower <= y["t"] <= x["t"] + upper
    )
    sa, sb = TestStream(timestamp=lambda e: e["t"]), TestStream(timestamp=lambda e: e["t"])
    ordered_a, ordered_b = sorted(a, key=lambda e: e["t"]), sorted(b, key=lambda e: e["t"])
    for i in range(0, 120, 30):  # both sides in event-time order, a batch at a time
        sa, sb = sa.add(ordered_a[i : i + 30]), sb.add(ordered_b[i : i + 30])
    late = {"id": "late", "k": "k1", "t": START + 5}
    sa = sa.add([late]).advance_watermark_to_end()
    sb = sb.advance_watermark_to_end()
    out = run_test(_interval_pipeline(-2, 3), {"a": sa, "b": sb})
    assert want, "the reference has pairs"
    assert sorted(out["out"]) == want
    assert [d["code"] for d in out.dead_letters] == [
        "late_for_join"
    ]  # a code of its own (issue 42)
    assert "late for the interval join" in out.dead_letters[0]["error"]


def _table_pipeline(how: str) -> Pipeline:
    from onceflow import sinks

    p = Pipeline("as-of")
    clicks = p.read("clicks", sources.Collection([])).key_by("user", lambda c: c["user"])
    users = p.read("users", sources.Collection([])).key_by("id", lambda u: u["key"])
    users = users.map_values("row", lambda u: u["value"])  # None: a tombstone
    clicks.map_values("page", lambda c: c["page"]).join_table("enriched", users, how=how).write(
        "out", sinks.Collect()
    )
    return p


def test_a_table_join_takes_the_row_as_of_each_records_time():
    t = START
    users = [
        ({"key": "u1", "value": {"plan": "free"}}, t + 1_000),
        ({"key": "u1", "value": {"plan": "pro"}}, t + 5_000),
        ({"key": "u2", "value": {"plan": "free"}}, t + 2_000),
        ({"key": "u2", "value": None}, t + 6_000),  # deleted from then on
    ]
    clicks = [
        ({"user": "u1", "page": "a"}, t + 500),  # before any row
        ({"user": "u1", "page": "b"}, t + 3_000),
        ({"user": "u1", "page": "c"}, t + 7_000),
        ({"user": "u2", "page": "d"}, t + 4_000),
        ({"user": "u2", "page": "e"}, t + 8_000),
        ({"user": "u3", "page": "f"}, t + 8_500),  # no row ever
    ]
    # the table's versions arrive after the clicks of their time, within the same watermark
    stream = TestStream().add_timestamped(clicks).advance_watermark(t)
    table = TestStream().add_timestamped([]).add_timestamped(users).advance_watermark(t)
    stream = stream.advance_watermark_to_end()
    table = table.advance_watermark_to_end()
    left = run_test(_table_pipeline("left"), {"clicks": stream, "users": table})
    assert sorted(left["out"], key=repr) == sorted(
        [
            ("u1", ("a", None)),
            ("u1", ("b", {"plan": "free"})),
            ("u1", ("c", {"plan": "pro"})),
            ("u2", ("d", {"plan": "free"})),
            ("u2", ("e", None)),
            ("u3", ("f", None)),
        ],
        key=repr,
    )
    inner = run_test(_table_pipeline("inner"), {"clicks": stream, "users": table})
    assert sorted(v[0] for _k, v in inner["out"]) == ["b", "c", "d"]
    assert left.dead_letters == [] and inner.dead_letters == []


def _windowed_table_pipeline() -> Pipeline:
    from onceflow import sinks, windows

    p = Pipeline("as-of-windows")
    clicks = p.read("clicks", sources.Collection([])).key_by("user", lambda c: c["user"])
    users = p.read("users", sources.Collection([])).key_by("id", lambda u: u["key"])
    users = users.map_values("row", lambda u: u["value"])
    joined = clicks.map_values("page", lambda c: c["page"]).join_table("enriched", users)
    joined.write("out", sinks.Collect())
    plans = joined.key_by("plan", lambda kv: kv[1][1]["plan"])
    plans.window("secs", windows.Fixed("1s")).count_per_key("n").write("counts", sinks.Collect())
    return p


def test_a_hot_key_leaves_in_one_batch_each_record_with_its_own_time():
    """Thousands of records of one key wait at distinct times; the watermark passes them all.

    They all leave in the micro-batch that passes them (one timer per key, not one per
    waiting time: thousands of firings per key were capped per batch, and the records beyond
    the cap were left for batches that a finite input never runs), and each keeps its own
    event time: counted per one-second window downstream, as a reference counts them.
    """
    t = START
    clicks = [({"user": "hot", "page": f"p{i}"}, t + 10 * i) for i in range(3_000)]
    users = [({"key": "hot", "value": {"plan": "pro"}}, t)]
    stream = TestStream().add_timestamped(clicks).advance_watermark(t + 40_000)
    table = TestStream().add_timestamped(users).advance_watermark(t + 40_000)
    out = run_test(_windowed_table_pipeline(), {"clicks": stream, "users": table})
    assert sorted(v[0] for _k, v in out["out"]) == sorted(f"p{i}" for i in range(3_000))
    want: dict[int, int] = {}
    for _c, ts in clicks:
        want[ts // 1_000 * 1_000] = want.get(ts // 1_000 * 1_000, 0) + 1
    got = {pane.start: pane.value for _plan, pane in out["counts"]}
    assert got == want
    assert out.dead_letters == []

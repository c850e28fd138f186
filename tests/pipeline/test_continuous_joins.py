"""Interval joins and joins with a table's versions, against plain-Python references."""

from __future__ import annotations

import random
import time

import pytest

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


def _deletes_input():
    """u1 and u2 are set, joined, deleted, joined with nothing; u1 is set again, joined again.

    One micro-batch per step, both sides' steps side by side; each table change arrives before
    the watermark passes it, and each click after the watermark passed the change before it.
    """
    t = START

    def row(key, value, at):
        return ({"key": key, "value": value}, at)

    def click(user, page, at):
        return ({"user": user, "page": page}, at)

    free = {"plan": "free"}
    table = (
        TestStream()
        .add_timestamped([row("u1", free, t + 1_000), row("u2", free, t + 1_000)])
        .advance_watermark(t + 2_500)
        .add_timestamped([row("u1", None, t + 3_000), row("u2", None, t + 3_000)])  # deleted
        .advance_watermark(t + 3_500)
        .advance_watermark(t + 4_000)
        .add_timestamped([row("u1", {"plan": "pro"}, t + 5_000)])  # u1 is back
        .advance_watermark_to_end()
    )
    clicks = (
        TestStream()
        .add_timestamped([click("u1", "a", t + 2_000), click("u2", "b", t + 2_000)])
        .advance_watermark(t + 2_500)
        .advance_watermark(t + 3_000)
        .advance_watermark(t + 3_500)
        .add_timestamped([click("u1", "c", t + 4_000), click("u2", "d", t + 4_000)])
        .add_timestamped([click("u1", "e", t + 6_000)])
        .advance_watermark_to_end()
    )
    return {"clicks": clicks, "users": table}


def _run(pipeline, inputs, mode, request, monkeypatch):
    """Run in process or on Spark with a real Redis; the outputs and the join's stored state.

    The state is read where it is stored (the evaluator's store; Redis, before the test run's
    namespace is deleted), decoded to ``{key: {spec name: value}}``.
    """
    from onceflow.kernel import codec
    from onceflow.sinks import Collect
    from onceflow.testing import evaluator, keyed_state
    from onceflow.testing import run as test_run

    step = "enriched.as-of"
    if mode == "memory":
        sinks: dict = {}
        dead = Collect()
        ev = evaluator.Evaluator(test_run.job_for_test(pipeline, inputs, sinks, dead))
        ev.run()
        assert dead.results == []
        stored = {
            codec.decode(kb): codec.decode(raw)[0]
            for (node, _p), values in ev.store.state.items()
            if node == step
            for kb, raw in values.items()
        }
        return {name: list(sink.results) for name, sink in sinks.items()}, stored

    spark, redis_url = request.getfixturevalue("spark"), request.getfixturevalue("redis_server").url
    seen: dict = {}
    forget = test_run._forget

    def read_then_forget(url, namespace):
        seen.update(keyed_state(url, namespace, step))
        forget(url, namespace)

    monkeypatch.setattr(test_run, "_forget", read_then_forget)
    out = run_test(pipeline, inputs, mode="spark", session=spark, redis_url=redis_url)
    assert out.dead_letters == []
    return out.sinks, {k: v["state"] for k, v in seen.items()}


MODES = ["memory", pytest.param("spark", marks=[pytest.mark.spark, pytest.mark.redis])]


@pytest.mark.parametrize("how", ["left", "inner"])
@pytest.mark.parametrize("mode", MODES)
def test_a_deleted_table_key_joins_no_more_and_its_state_is_deleted(
    how, mode, request, monkeypatch
):
    """After ``(key, None)`` on the table side a record of the key joins as with no row.

    Once the watermark passes the deletion, nothing of the key is kept (no deleted row, no
    floor): u2's state is gone from the store, u1 keeps only its row set again.
    """
    out, state = _run(_table_pipeline(how), _deletes_input(), mode, request, monkeypatch)
    want = [
        ("u1", ("a", {"plan": "free"})),
        ("u2", ("b", {"plan": "free"})),
        ("u1", ("c", None)),  # u1 and u2 deleted at 3 s
        ("u2", ("d", None)),
        ("u1", ("e", {"plan": "pro"})),  # u1 set again at 5 s
    ]
    if how == "inner":
        want = [kv for kv in want if kv[1][1] is not None]
    assert sorted(out["out"], key=repr) == sorted(want, key=repr)
    assert state == {"u1": {"versions": [[START + 5_000, {"plan": "pro"}]]}}


def test_a_table_of_changes_joins_each_changes_row_and_a_delete_deletes():
    """A change stream keyed by its rows' key is a table: a Change stands for its row."""
    from onceflow import Change, sinks

    t = START

    def change(op, key, after, at):
        return Change(op, "public.users", {"id": key}, None, after, at, f"lsn={at}")

    p = Pipeline("as-of-changes")
    clicks = p.read("clicks", sources.Collection([])).key_by("user", lambda c: c["user"])
    users = p.read("users", sources.Collection([])).key_by("id", lambda c: c.key_value)
    joined = clicks.map_values("page", lambda c: c["page"]).join_table("enriched", users)
    joined.write("out", sinks.Collect())
    table = [
        (change("read", 1, {"id": 1, "plan": "free"}, t + 1_000), t + 1_000),
        (change("update", 1, {"id": 1, "plan": "pro"}, t + 2_000), t + 2_000),
        (change("delete", 1, None, t + 3_000), t + 3_000),
        (Change("truncate", "public.users", None, None, None, t + 3_500, "lsn=9"), t + 3_500),
    ]
    clicks_in = [({"user": 1, "page": p}, t + at) for p, at in [("a", 1_500), ("b", 2_500)]]
    clicks_in.append(({"user": 1, "page": "c"}, t + 4_000))
    out = run_test(
        p,
        {
            "clicks": TestStream().add_timestamped(clicks_in).advance_watermark_to_end(),
            "users": TestStream().add_timestamped(table).advance_watermark_to_end(),
        },
    )
    assert sorted(out["out"], key=repr) == [
        (1, ("a", {"id": 1, "plan": "free"})),
        (1, ("b", {"id": 1, "plan": "pro"})),
        (1, ("c", None)),
    ]
    assert [d["code"] for d in out.dead_letters] == ["user_error"]
    assert "got a truncate change of 'public.users'" in out.dead_letters[0]["error"]


def test_random_rows_deletes_and_records_join_as_a_reference_and_leave_one_row_per_key(
    monkeypatch, request
):
    """Rows set, replaced and deleted at random, records in between, a batch per 10 s.

    Every record joins the row its key held at its time (a plain-Python as-of lookup over all
    versions), and at the end the state holds each key's last row only, none of a deleted key.
    """
    rng = random.Random(7)
    t, keys, span = START, [f"u{i}" for i in range(6)], 10_000
    times = rng.sample(range(8 * span), 240)  # distinct: one version per key and time
    versions = [(rng.choice(keys), rng.choice([None, rng.randrange(9)]), at) for at in times[:120]]
    clicks = [(rng.choice(keys), f"p{i}", at) for i, at in enumerate(times[120:])]
    table, stream = TestStream(), TestStream()
    for start in range(0, 8 * span, span):  # each batch: the next 10 s of both sides
        here = [
            ({"key": k, "value": None if v is None else {"plan": v}}, t + at)
            for k, v, at in versions
            if start <= at < start + span
        ]
        table = table.add_timestamped(here).advance_watermark(t + start + span)
        mine = [
            ({"user": k, "page": p}, t + at) for k, p, at in clicks if start <= at < start + span
        ]
        stream = stream.add_timestamped(mine).advance_watermark(t + start + span)
    inputs = {
        "clicks": stream.advance_watermark_to_end(),
        "users": table.advance_watermark_to_end(),
    }
    out, state = _run(_table_pipeline("left"), inputs, "memory", request, monkeypatch)

    def as_of(key, at):
        before = [(vt, v) for k, v, vt in versions if k == key and vt <= at]
        found = max(before, default=(None, None))[1]
        return None if found is None else {"plan": found}

    want = [(k, (p, as_of(k, at))) for k, p, at in clicks]
    assert sum(v is None for _k, v, _at in versions) > 10, "the draw deletes rows"
    assert sorted(out["out"], key=repr) == sorted(want, key=repr)
    last = {k: (t + at, v) for k, v, at in sorted(versions, key=lambda e: e[2])}
    kept = {k: (at, {"plan": v}) for k, (at, v) in last.items() if v is not None}
    assert set(state) == set(kept), "a deleted key's state is gone, a set key's kept"
    for k, (at, row) in kept.items():  # its last row (and a floor, if older rows went)
        assert state[k]["versions"] == [[at, row]]
        assert state[k].get("floor", at) <= at

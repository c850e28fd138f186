"""Windowed joins and co_group against a plain-Python reference, bounded and streaming."""

from __future__ import annotations

import random
import time
from collections import defaultdict

import pytest

from onceflow import CoGroup, Pipeline, sinks, sources
from onceflow.connectors.collect import Collect
from onceflow.pipeline.errors import PipelineError
from onceflow.testing import TestStream, run_test

WINDOW_MS = 10_000
OUTS = ("inner", "left", "right", "outer", "co_group")
START = (int(time.time() * 1000) - 3_600_000) // WINDOW_MS * WINDOW_MS


def _events(seed: int, n: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    orders = [
        {"order": f"o{i}", "user": f"u{rng.randrange(6)}", "t": START + rng.randrange(60_000)}
        for i in range(n)
    ]
    payments = [
        {"pay": f"p{i}", "user": f"u{rng.randrange(8)}", "t": START + rng.randrange(60_000)}
        for i in range(n)
    ]
    return orders, payments


def _reference(orders, payments, how):
    by = defaultdict(lambda: ([], []))
    for o in orders:
        by[(o["user"], o["t"] // WINDOW_MS)][0].append(o["order"])
    for p in payments:
        by[(p["user"], p["t"] // WINDOW_MS)][1].append(p["pay"])
    out = []
    for (user, _w), (ls, rs) in by.items():
        if ls and rs:
            out += [(user, (a, b)) for a in ls for b in rs]
        elif ls and how in ("left", "outer"):
            out += [(user, (a, None)) for a in ls]
        elif rs and how in ("right", "outer"):
            out += [(user, (None, b)) for b in rs]
    return sorted(out, key=repr)


def _build(p: Pipeline, orders_src, payments_src) -> dict[str, Collect]:
    outs = {how: sinks.Collect() for how in OUTS}
    orders = p.read("orders", orders_src).key_by("o-user", lambda o: o["user"])
    payments = p.read("payments", payments_src).key_by("p-user", lambda x: x["user"])
    orders = orders.map_values("o-id", lambda o: o["order"])
    payments = payments.map_values("p-id", lambda x: x["pay"])
    for how in ("inner", "left", "right", "outer"):
        orders.join(f"j-{how}", payments, WINDOW_MS / 1000, how=how).write(how, outs[how])
    orders.co_group("grouped", payments, "10s").write("co_group", outs["co_group"])
    return outs


def _check(orders, payments, results) -> None:
    for how in ("inner", "left", "right", "outer"):
        got = sorted(results[how], key=repr)
        assert got == _reference(orders, payments, how), how
    groups = results["co_group"]
    assert all(isinstance(g, CoGroup) and g.end - g.start == WINDOW_MS for _k, g in groups)
    assert sum(len(g.left) for _k, g in groups) == len(orders)
    assert sum(len(g.right) for _k, g in groups) == len(payments)


def test_bounded_joins_match_the_reference(spark, tmp_path):
    orders, payments = _events(1, 120)
    p = Pipeline("joins")
    outs = _build(
        p,
        sources.Collection(orders, timestamp=lambda o: o["t"]),
        sources.Collection(payments, timestamp=lambda x: x["t"]),
    )
    p.run(session=spark, progress=False, output_dir=str(tmp_path))
    _check(orders, payments, {how: c.results for how, c in outs.items()})


def test_streaming_joins_fire_once_per_window_and_late_records_are_dead_letters():
    orders, payments = _events(2, 150)
    late = {"order": "late", "user": "u1", "t": START + 1}
    p = Pipeline("joins-stream")
    _build(p, sources.Collection([]), sources.Collection([]))
    o_stream = TestStream(timestamp=lambda o: o["t"])
    p_stream = TestStream(timestamp=lambda x: x["t"])
    by_time_o = sorted(orders, key=lambda o: o["t"])
    by_time_p = sorted(payments, key=lambda x: x["t"])
    for i in range(0, 150, 50):  # micro-batches of both sides, in event-time order
        o_stream = o_stream.add(by_time_o[i : i + 50])
        p_stream = p_stream.add(by_time_p[i : i + 50])
    o_stream = o_stream.advance_watermark_to_end().add([late])
    p_stream = p_stream.advance_watermark_to_end()
    out = run_test(p, {"orders": o_stream, "payments": p_stream})
    _check(orders, payments, {how: list(out[how]) for how in OUTS})
    assert {d["code"] for d in out.dead_letters} == {"window_closed"}


def test_joins_are_refused_on_unkeyed_or_already_windowed_streams():
    p = Pipeline("bad-joins")
    a = p.read("a", sources.Collection([1]))
    b = p.read("b", sources.Collection([2])).key_by("kb", lambda x: x)
    with pytest.raises(PipelineError, match="needs a keyed stream"):
        a.join("j", b, 10)
    windowed = a.key_by("ka", lambda x: x).window("w", 10)
    with pytest.raises(PipelineError, match="already windowed"):
        windowed.join("j2", b, 10)
    with pytest.raises(PipelineError, match="how="):
        b.join("j3", b, 10, how="cross")

"""Records made by event-time firings feeding a window downstream, against a reference.

A pane leaves at its window's last millisecond and a timer's output at the timer's time: both
are behind the watermark of the micro-batch that fires them. A window downstream that ends
between the batch before's watermark and this batch's has not fired yet: it must take them
(and fire at the end of the batch), not call them late.
"""

from __future__ import annotations

import time
from collections import Counter

from onceflow import Pipeline, sinks, sources, windows
from onceflow.state import BagSpec
from onceflow.testing import TestStream, run_test

START = (int(time.time() * 1000) - 3_600_000) // 60_000 * 60_000
EVENTS = [{"k": f"k{i % 3}", "t": START + 137 * i} for i in range(600)]  # ~82 s, 3 keys


def _stream() -> TestStream:
    stream = TestStream(timestamp=lambda e: e["t"])
    for i in range(0, len(EVENTS), 70):  # batches that cut through windows
        stream = stream.add(EVENTS[i : i + 70])
    return stream.advance_watermark_to_end()


def _reference(size_ms: int) -> Counter[tuple[str, int]]:
    return Counter((e["k"], (e["t"] - START) // size_ms * size_ms) for e in EVENTS)


def test_per_second_panes_sum_into_ten_second_windows():
    p = Pipeline("cascade")
    per_second = (
        p.read("in", sources.Collection([]))
        .key_by("k", lambda e: e["k"])
        .window("secs", windows.Fixed("1s"))
        .count_per_key("n1")
    )
    (
        per_second.key_by("k2", lambda kv: kv[0])
        .map_values("v", lambda kv: kv[1].value)
        .window("tens", windows.Fixed("10s"))
        .combine_per_key("n10", "sum")
        .write("out", sinks.Collect())
    )
    out = run_test(p, {"in": _stream()})
    got = Counter({(k, pane.start - START): pane.value for k, pane in out["out"]})
    assert got == _reference(10_000)
    assert out.dead_letters == []


BUFFER = BagSpec[int]("buffer")


def _buffer(key, e, ctx):
    ctx.state(BUFFER).add(e["t"])
    ctx.timers.set_event_time(e["t"] // 1_000 * 1_000 + 999, f"s{e['t'] // 1_000}")
    return []


def _release(key, timer, ctx):
    """Each second's records, at the second's last millisecond (the timer's time)."""
    held = ctx.state(BUFFER).read()
    due = [t for t in held if t <= timer.time]
    ctx.state(BUFFER).write([t for t in held if t > timer.time])
    return [(key, t) for t in due]


def test_what_a_timer_releases_is_counted_in_the_window_of_its_time():
    p = Pipeline("timer-cascade")
    (
        p.read("in", sources.Collection([]))
        .key_by("k", lambda e: e["k"])
        .process("hold", _buffer, states=[BUFFER], on_timer=_release)
        .key_by("k2", lambda kv: kv[0])
        .window("tens", windows.Fixed("10s"))
        .count_per_key("n10")
        .write("out", sinks.Collect())
    )
    out = run_test(p, {"in": _stream()})
    got = Counter({(k, pane.start - START): pane.value for k, pane in out["out"]})
    assert got == _reference(10_000)
    assert out.dead_letters == []


def test_an_output_may_move_forward_in_event_time_never_back():
    from onceflow.state import TimestampedValue

    def stamp(key, e, ctx):
        return [TimestampedValue((key, e["shift"]), ctx.timestamp + e["shift"])]

    p = Pipeline("stamps")
    (
        p.read("in", sources.Collection([]))
        .key_by("k", lambda e: e["k"])
        .process("stamp", stamp)
        .key_by("k2", lambda kv: kv[0])
        .window("tens", windows.Fixed("10s"))
        .count_per_key("n")
        .write("out", sinks.Collect())
    )
    at = START + 5_000
    stream = TestStream(timestamp=lambda e: e["t"]).add(
        [{"k": "a", "t": at, "shift": s} for s in (0, 7_000, 20_000, -1)]
    )
    out = run_test(p, {"in": stream.advance_watermark_to_end()})
    got = sorted((pane.start - START, pane.value) for _k, pane in out["out"])
    assert got == [(0, 1), (10_000, 1), (20_000, 1)]  # 5 s, 12 s, 25 s
    assert [d["code"] for d in out.dead_letters] == ["user_error"]
    assert "may only move forward in event time" in out.dead_letters[0]["error"]


def test_a_process_stage_after_a_window_sees_its_panes_on_time():
    """Elements see the watermark the batch started from: a pane (behind the watermark of the
    batch that fired it) is not late for a process stage, nor for an interval join."""

    def lateness(key, kv, ctx):
        return [(key, "late" if ctx.timestamp < ctx.watermark else "on time")]

    p = Pipeline("pane-process")
    panes = (
        p.read("in", sources.Collection([]))
        .key_by("k", lambda e: e["k"])
        .window("secs", windows.Fixed("1s"))
        .count_per_key("n1")
        .key_by("k2", lambda kv: kv[0])
    )
    panes.process("check", lateness).write("out", sinks.Collect())
    panes.interval_join("pairs", panes, 0, 0).write("pairs-out", sinks.Collect())
    out = run_test(p, {"in": _stream()})
    seconds = {(e["k"], (e["t"] - START) // 1_000) for e in EVENTS}
    assert Counter(v for _k, v in out["out"]) == Counter({"on time": len(seconds)})
    assert len(out["pairs-out"]) == len(seconds)  # each pane with itself
    assert out.dead_letters == []

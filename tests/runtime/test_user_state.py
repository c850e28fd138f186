"""User state handles and the process op on their own (no Spark, no Redis): what a function
sees, what is stored, which timers fire, and what a failing call leaves behind.

The op's state writes are checked as the commit would store them (a dict standing in for
the state hash, the ``event``/``processing``/``expiry`` scores as written), so the stored
form and the timer scores the end of a task reads are pinned here; the end-to-end proof
(Redis, Kafka, kill -9) is tests/exactly_once/test_user_state.py.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from onceflow.combiners import Count, Sum
from onceflow.kernel import codec
from onceflow.kernel.records import Guarantee
from onceflow.pipeline.errors import PipelineError
from onceflow.runtime.ops.process import ProcessOp
from onceflow.runtime.ops.record_text import Cursor
from onceflow.runtime.spec import OpKind, OpSpec
from onceflow.runtime.user_state import ProcessSpec
from onceflow.state import BagSpec, CombiningSpec, MapSpec, ValueSpec

COUNT = ValueSpec[int]("count")
SEEN = BagSpec[int]("seen")
BY = MapSpec[tuple, int]("by")
TOTAL = CombiningSpec[int]("total", Sum())
STATES = (COUNT, SEEN, BY, TOTAL)


class Store:
    """The state hash and timer sets of one node and partition, as the commit writes them."""

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}
        self.timers: dict[str, dict[bytes, int]] = {}

    def read(self, node: str, keys: Any) -> dict[bytes, bytes | None]:
        return {k: self.values.get(k) for k in keys}

    def write(self, write: Any) -> None:
        for kb, v in write.values.items():
            if v is None:
                self.values.pop(kb, None)
            else:
                self.values[kb] = v
        for kind, members in write.timers.items():
            zset = self.timers.setdefault(kind, {})
            for kb, at in members.items():
                if at is None:
                    zset.pop(kb, None)
                else:
                    zset[kb] = at

    def due(self, node: str, watermark: int, now: int) -> list[bytes]:
        event = [k for k, at in self.timers.get("event", {}).items() if at <= watermark]
        proc = [k for k, at in self.timers.get("processing", {}).items() if at <= now]
        return event + proc


def op(fn, on_timer=None, *, batch=1, watermark=0, now=1000, ttl_ms=None, failures=None):
    spec = OpSpec("p", OpKind.PROCESS, (), (), process=ProcessSpec(fn, on_timer, STATES, ttl_ms))
    out: list[Any] = []

    def fail(node, exc, what):
        if failures is None:
            raise exc
        failures.append((what, str(exc)) if node == "p" else (node, what, str(exc)))

    proc = ProcessOp.build(
        spec, (batch, watermark, now, Guarantee.EXACTLY_ONCE), Cursor(), fail, out.append
    )
    return proc, out


def feed(proc, store, records):
    for key, value, ts in records:
        proc.cursor.parent = f"{key}-{value}".encode()
        proc.cursor.ts = ts
        proc.add(codec.encode(key), key, value, ts)
    store.write(proc.updates(store.read))
    proc.chunk_committed()


def counting(key, value, ctx):
    n = (ctx.state(COUNT).read() or 0) + 1
    ctx.state(COUNT).write(n)
    ctx.state(SEEN).add(value)
    ctx.state(BY).put((key, value), n)
    ctx.state(TOTAL).add(value)
    yield (key, n, ctx.state(TOTAL).read(), ctx.timestamp)


def test_handles_read_back_what_was_written_across_chunks():
    store = Store()
    proc, out = op(counting)
    feed(proc, store, [("a", 1, 10), ("b", 5, 11), ("a", 2, 12)])
    feed(proc, store, [("a", 3, 13)])  # a later chunk reads the committed state
    assert out == [("a", 1, 1, 10), ("a", 2, 3, 12), ("b", 1, 5, 11), ("a", 3, 6, 13)]
    cells, timers, expiry = codec.decode(store.values[codec.encode("a")])
    assert cells == {
        "count": 3,
        "seen": [1, 2, 3],
        "by": [[("a", 1), 1], [("a", 2), 2], [("a", 3), 3]],
        "total": 6,
    }
    assert (timers, expiry) == ([], None)
    assert store.timers.get("event", {}) == {}  # no timer: no score


def test_clearing_everything_deletes_the_key():
    store = Store()

    def clearing(key, value, ctx):
        if value == "clear":
            for spec in STATES:
                ctx.state(spec).clear()
        else:
            ctx.state(COUNT).write(1)
            ctx.state(SEEN).add(1)
            ctx.state(BY).put(1, 1)
            ctx.state(TOTAL).add(1)

    proc, _ = op(clearing)
    feed(proc, store, [("a", "set", 1)])
    assert codec.encode("a") in store.values
    feed(proc, store, [("a", "clear", 2)])
    assert store.values == {}


def test_a_failing_call_leaves_the_state_as_it_was_and_is_a_dead_letter():
    store = Store()
    failures: list[Any] = []

    def flaky(key, value, ctx):
        ctx.state(SEEN).add(value)
        ctx.state(BY).put(value, value)
        ctx.timers.set_event_time(100 + value)
        if value == 2:
            raise ValueError("no twos")
        return [value]

    proc, out = op(flaky, lambda k, t, c: [], failures=failures)
    feed(proc, store, [("a", 1, 0), ("a", 2, 0), ("a", 3, 0)])
    assert out == [1, 3]
    assert failures == [(("a", 2), "no twos")]
    cells, timers, _ = codec.decode(store.values[codec.encode("a")])
    assert cells["seen"] == [1, 3] and cells["by"] == [[1, 1], [3, 3]]
    assert timers == [["", "event", 103, 0]]


def test_a_keys_records_that_all_succeed_encode_its_state_once_per_chunk(monkeypatch):
    """Encoding the state after every call costs the whole state per record: quadratic for
    a key that buffers (a join's waiting records). A chunk's calls of one key that all
    succeed encode it once; outputs still leave in order, each with its record's cursor."""
    from onceflow.runtime.ops import process as process_op

    encoded = []
    real = process_op.KeyState.snapshot
    monkeypatch.setattr(
        process_op.KeyState, "snapshot", lambda self, specs: encoded.append(1) or real(self, specs)
    )
    store = Store()
    proc, out = op(counting)
    seen_parents = []
    proc.out = lambda r: (seen_parents.append(proc.cursor.parent), out.append(r))
    feed(proc, store, [("a", v, 10 * v) for v in range(1, 201)])
    assert len(encoded) == 1
    assert out == [("a", n, n * (n + 1) // 2, 10 * n) for n in range(1, 201)]
    assert seen_parents == [f"a-{v}".encode() for v in range(1, 201)]


def test_a_value_that_cannot_be_stored_fails_its_own_record_only():
    store = Store()
    failures: list[Any] = []

    def storing(key, value, ctx):
        ctx.state(COUNT).write(object() if value == "bad" else value)

    proc, _ = op(storing, failures=failures)
    feed(proc, store, [("a", "ok", 0), ("a", "bad", 0)])
    assert [f[0] for f in failures] == [("a", "bad")]
    assert codec.decode(store.values[codec.encode("a")])[0] == {"count": "ok"}


def sessions(key, value, ctx):
    ctx.state(SEEN).add(value)
    ctx.timers.set_event_time(ctx.timestamp + 10)  # moves the one timer on
    if value == "ping":
        ctx.timers.set_processing_time(ctx.now + 500, tag="ping")


def emit_bag(key, timer, ctx):
    values = ctx.state(SEEN).read()
    ctx.state(SEEN).clear()
    return [(key, timer.domain, timer.tag, timer.time, ctx.timestamp, values)]


def test_event_timers_fire_when_the_watermark_passes_them_and_only_then():
    store = Store()
    proc, out = op(sessions, emit_bag, watermark=0)
    feed(proc, store, [("a", 1, 100), ("b", 2, 105), ("a", 3, 103)])
    assert store.timers["event"] == {codec.encode("a"): 113, codec.encode("b"): 115}
    store.write(proc.fire(store.read, store.due))
    assert out == []  # the watermark (0) has not reached them

    nxt, out = op(sessions, emit_bag, batch=2, watermark=114)
    store.write(nxt.fire(store.read, store.due))
    assert out == [("a", "event", "", 113, 113, [1, 3])]
    assert store.timers["event"] == {codec.encode("b"): 115}
    assert codec.encode("a") not in store.values  # bag emptied, no timer left


def test_processing_timers_fire_on_batch_time_and_carry_the_setters_event_time():
    store = Store()
    proc, out = op(sessions, emit_bag, now=1000)
    feed(proc, store, [("a", "ping", 50)])
    assert store.timers["processing"] == {codec.encode("a"): 1500}
    later, out = op(sessions, emit_bag, batch=2, watermark=0, now=1500)
    store.write(later.fire(store.read, store.due))
    assert out == [("a", "processing", "ping", 1500, 50, ["ping"])]
    assert store.timers["processing"] == {}
    assert store.timers["event"] == {codec.encode("a"): 60}  # the event timer stays


def test_timers_set_while_firing_fire_in_the_same_task_with_distinct_ids():
    store = Store()

    def rearm(key, timer, ctx):
        if timer.time < 30:
            ctx.timers.set_event_time(timer.time + 10)
        return [(timer.time, ctx.state(COUNT).read())]

    def once(key, value, ctx):
        ctx.state(COUNT).write(value)
        ctx.timers.set_event_time(10)

    proc, _ = op(once, rearm)
    feed(proc, store, [("a", 7, 0)])
    ids = []
    firing, out = op(once, rearm, batch=5, watermark=100)
    firing.out = lambda elem: (out.append(elem), ids.append(firing.cursor.parent))
    store.write(firing.fire(store.read, store.due))
    assert out == [(10, 7), (20, 7), (30, 7)]
    assert len(set(ids)) == 3
    again, _ = op(once, rearm, batch=5, watermark=100)  # a retry of the task: same IDs
    assert again.deriver is not None
    assert [again.deriver.of(5, codec.encode("a"), n) for n in range(3)] == ids


def test_state_ends_with_its_time_to_live():
    store = Store()
    proc, _ = op(counting, now=1000, ttl_ms=500)
    feed(proc, store, [("a", 1, 0)])
    assert store.timers["expiry"] == {codec.encode("a"): 1500}
    within, out = op(counting, now=1499, ttl_ms=500)
    feed(within, store, [("a", 1, 0)])
    assert out[-1][1] == 2
    assert store.timers["expiry"] == {codec.encode("a"): 1999}  # moved on by the write
    after, out = op(counting, now=1999, ttl_ms=500)
    feed(after, store, [("a", 1, 0)])
    assert out[-1][1] == 1  # expired: starts afresh


def test_a_refused_commit_forgets_the_chunk():
    store = Store()
    proc, out = op(counting)
    proc.add(codec.encode("a"), "a", 1, 0)
    proc.updates(store.read)
    proc.reset_chunk()  # the commit was refused: nothing stored, the chunk runs again
    feed(proc, store, [("a", 1, 0)])
    assert codec.decode(store.values[codec.encode("a")])[0]["count"] == 1


def test_a_failing_timer_is_consumed_and_its_letter_names_on_timer():
    store = Store()
    failures: list[Any] = []

    def set_two(key, value, ctx):
        ctx.state(COUNT).write(1)
        ctx.timers.set_event_time(5, "bad")
        ctx.timers.set_event_time(6, "good")

    def fire(key, timer, ctx):
        ctx.state(COUNT).write(2)
        if timer.tag == "bad":
            raise RuntimeError("bad timer")
        return [(timer.tag, ctx.state(COUNT).read())]

    proc, _ = op(set_two, fire, failures=failures)
    feed(proc, store, [("a", 1, 0)])
    firing, out = op(set_two, fire, watermark=10, failures=failures)
    store.write(firing.fire(store.read, store.due))
    assert out == [("good", 2)]  # the bad one's write of 2 was undone, the good one's kept
    assert failures == [("p/on_timer", ("a", ["bad", "event", 5, 0]), "bad timer")]
    assert codec.decode(store.values[codec.encode("a")])[:2] == [{"count": 2}, []]


def test_undeclared_state_and_timers_without_on_timer_are_errors():
    failures: list[Any] = []
    other = ValueSpec[int]("other")
    proc, _ = op(lambda k, v, ctx: ctx.state(other).write(1), failures=failures)
    feed(proc, Store(), [("a", 1, 0)])
    assert "not declared" in failures[0][1]
    failures.clear()
    proc, _ = op(lambda k, v, ctx: ctx.timers.set_event_time(5), failures=failures)
    feed(proc, Store(), [("a", 1, 0)])
    assert "no on_timer" in failures[0][1]


def test_process_is_declared_on_keyed_streams_with_unique_states():
    from onceflow import Pipeline, sources

    p = Pipeline("decl")
    stream = p.read("in", sources.Collection([1]))
    with pytest.raises(PipelineError, match="needs a keyed stream"):
        stream.process("p", counting)
    keyed = stream.key_by("k", lambda x: x)
    with pytest.raises(PipelineError, match="twice"):
        keyed.process("p", counting, states=[COUNT, ValueSpec[int]("count")])
    with pytest.raises(PipelineError, match="ttl"):
        keyed.process("q", counting, states=[COUNT], state_ttl=0)


def fraud_reference(rows):
    """examples/fraud_rule.py's outputs, computed in plain Python (one pass per card)."""
    from examples import fraud_rule as ex

    out = []
    cards: dict[str, list] = {}
    for row in rows:
        cards.setdefault(row["card"], []).append(row)
    for card, mine in cards.items():
        recent: list[float] = []
        for p in mine:
            mean = sum(recent) / len(recent) if recent else 0
            if len(recent) >= 3 and p["amount"] > ex.FACTOR * mean:
                out.append({"alert": card, "amount": p["amount"], "mean": mean})
            recent = [*recent, p["amount"]][-ex.HISTORY :]
        out.append(
            {
                "card": card,
                "payments": len(mine),
                "merchants": len({p["merchant"] for p in mine}),
                "total": sum(p["amount"] for p in mine),
                "idle_since": mine[-1]["ts"],
            }
        )
    return out


def test_the_docs_example_runs_bounded_and_every_timer_fires_at_the_end(tmp_path, monkeypatch):
    """examples/fraud_rule.py (docs/guide/state.md) against its plain-Python reference."""
    import importlib
    import json

    from examples import fraud_rule

    monkeypatch.chdir(tmp_path)
    ex = importlib.reload(fraud_rule)  # its sink's path is made absolute when it is built
    ex.pipeline.run(master="local[1]", progress=False)  # one split: the rows' order per card
    written = (tmp_path / "onceflow-output" / "fraud-rule.jsonl").read_text().splitlines()
    got = [json.loads(line) for line in written]
    key = json.dumps
    assert sorted(got, key=key) == sorted(fraud_reference(ex.payments()), key=key)
    assert any("alert" in g for g in got)


def test_timers_fire_as_a_test_stream_moves_the_watermark_and_the_clock():
    """Through the task loop (in-process evaluator): event timers by watermark, processing
    timers by batch time, each once."""
    from onceflow import Pipeline, sinks, sources
    from onceflow.testing import TestStream, run_test

    def remind(key, value, ctx):
        ctx.state(SEEN).add(value)
        ctx.timers.set_event_time(ctx.timestamp + 1_000, "event")
        ctx.timers.set_processing_time(ctx.now + 60_000, "clock")

    def fired(key, timer, ctx):
        return [(key, timer.tag, ctx.state(SEEN).read())]

    start = 1_800_000_000_000
    p = Pipeline("timers-in-memory")
    (
        p.read("in", sources.Collection([]))
        .key_by("k", lambda x: x["k"])
        .map_values("v", lambda x: x["v"])
        .process("p", remind, states=STATES, on_timer=fired)
        .write("out", sinks.Collect())
    )
    stream = (
        TestStream(timestamp=lambda x: x["ts"])
        .add([{"k": "a", "v": 1, "ts": start}, {"k": "b", "v": 2, "ts": start + 5_000}])
        .advance_watermark(start + 2_000)  # a's event timer (start + 1 s) is due, not b's
        .add([])
    )
    clock = start + 600_000  # the batch clock, ahead of the event times
    out = run_test(p, {"in": stream}, start_time_ms=clock)
    assert out["out"] == [("a", "event", [1])]
    later = stream.advance_processing_time("2m")  # both keys' clock timers are due
    out = run_test(p, {"in": later}, start_time_ms=clock)
    assert sorted(out["out"]) == [("a", "clock", [1]), ("a", "event", [1]), ("b", "clock", [2])]


def test_unchanged_state_is_not_written_and_a_stale_timer_score_is_removed():
    store = Store()
    proc, _ = op(counting)
    feed(proc, store, [("a", 1, 0)])
    reader, _ = op(lambda key, value, ctx: [ctx.state(COUNT).read()])
    reader.add(codec.encode("a"), "a", 9, 0)
    assert not reader.updates(store.read)  # nothing changed: nothing to commit
    # gc deleted an expired key's state, its event-time score is left: it is due once
    store.timers.setdefault("event", {})[codec.encode("gone")] = 5
    firing, out = op(counting, emit_bag, watermark=10)
    store.write(firing.fire(store.read, store.due))
    assert out == [] and store.timers["event"] == {}


def test_the_declared_state_is_part_of_the_plans_fingerprint():
    """Another spec name or kind is another stored format: a resumed run must refuse it."""
    from onceflow import Pipeline, sinks, sources

    def fingerprint(states, fn=counting):
        p = Pipeline("fp")
        (
            p.read("in", sources.Collection([1]))
            .key_by("k", lambda x: x)
            .process("p", fn, states=states)
            .write("out", sinks.Collect())
        )
        return p.job().fingerprint

    same = fingerprint(STATES)
    assert fingerprint(STATES, fn=lambda k, v, ctx: None) == same  # code may change
    assert fingerprint((*STATES[:3], CombiningSpec[int]("total", Count()))) != same
    assert fingerprint((*STATES[:3], ValueSpec[int]("total"))) != same
    assert fingerprint((*STATES[:3], CombiningSpec[int]("sum", Sum()))) != same


def _reminders():
    """A process stage whose processing-time timer emits once per key, into 10 s windows."""
    from onceflow import Fixed, Pipeline, sinks, sources

    def remind(key, value, ctx):
        ctx.timers.set_processing_time(ctx.now + 60_000, "later")

    def fired(key, timer, ctx):
        return [key]

    p = Pipeline("reminders")
    (
        p.read("in", sources.Collection([]))
        .key_by("k", lambda x: x["k"])
        .process("remind", remind, on_timer=fired)
        .key_by("by-key", lambda key: key)
        .map_values("one", lambda key: 1)
        .window("per-10s", Fixed("10s"))
        .combine_per_key("reminded", "sum")
        .write("out", sinks.Collect())
    )
    return p


@pytest.mark.parametrize(
    "mode", ["memory", pytest.param("spark", marks=[pytest.mark.spark, pytest.mark.redis])]
)
def test_a_processing_timers_outputs_are_taken_by_a_window_downstream(mode, request):
    """Issue 37, R3: the watermark passes the event time of the elements that set them long
    before their processing-time timers fire; the firings' outputs must still land in an open
    window (not ``window_closed`` dead letters), and its pane must leave."""
    from onceflow.testing import TestStream, run_test

    start = (int(time.time()) // 60_000 - 60) * 60_000  # an hour ago, on a minute
    stream = (
        TestStream(timestamp=lambda x: x["ts"])
        .add([{"k": "a", "ts": start + 1_000}, {"k": "b", "ts": start + 2_000}])
        .advance_watermark(start + 45_000)  # their 10 s window closes
        .add([])
        .advance_processing_time("2m")  # both timers fire
        .advance_watermark(start + 90_000)  # the windows the firings landed in close
        .add([])
    )
    spark = {}
    if mode == "spark":
        spark = {
            "session": request.getfixturevalue("spark"),
            "redis_url": request.getfixturevalue("redis_server").url,
        }
    out = run_test(_reminders(), {"in": stream}, mode=mode, **spark)
    assert not out.dead_letters, out.dead_letters
    assert sorted(key for key, _ in out["out"]) == ["a", "b"], out["out"]


def test_a_processing_timers_outputs_are_on_time_for_an_interval_join_downstream():
    """Issue 37, R3: ... nor late for an interval join (``late for the interval join``)."""
    from onceflow import Pipeline, sinks, sources
    from onceflow.testing import TestStream, run_test

    def remind(key, value, ctx):
        ctx.timers.set_processing_time(ctx.now + 60_000, "later")

    p = Pipeline("reminders-joined")
    reminders = (
        p.read("in", sources.Collection([]))
        .key_by("k", lambda x: x["k"])
        .process("remind", remind, on_timer=lambda key, timer, ctx: [key])
        .key_by("by-key", lambda key: key)
    )
    answers = p.read("answers", sources.Collection([])).key_by("answer-key", lambda x: x["k"])
    reminders.interval_join("answered", answers, 0, 30).write("out", sinks.Collect())
    start = (int(time.time()) // 60_000 - 60) * 60_000
    stream = (
        TestStream(timestamp=lambda x: x["ts"])
        .add([{"k": "a", "ts": start + 1_000}])
        .advance_watermark(start + 45_000)
        .add([])
        .advance_processing_time("2m")  # the timer fires, its output joins the answer
        .advance_watermark(start + 200_000)
    )
    answer = TestStream(timestamp=lambda x: x["ts"]).add([]).add([]).add([])
    answer = answer.add([{"k": "a", "ts": start + 50_000}])
    out = run_test(p, {"in": stream, "answers": answer})
    assert not out.dead_letters, out.dead_letters
    assert [key for key, _ in out["out"]] == ["a"], out["out"]

"""Bounded runs end to end on Spark: results, dead letters, failures."""

from __future__ import annotations

import json
import os

import pytest

from onceflow.pipeline import Pipeline, sinks, sources
from onceflow.runtime.errors import RunError

pytestmark = pytest.mark.spark


def test_word_count_from_a_text_file(spark, tmp_path):
    from onceflow.cli.demo import wordcount

    text = tmp_path / "in.txt"
    text.write_text("the cat\nthe dog the end\n\nCat\n")
    sink = sinks.Collect()
    result = wordcount.build(str(text), sink).run(
        session=spark, progress=False, output_dir=str(tmp_path)
    )
    assert sorted(sink.results) == [("cat", 2), ("dog", 1), ("end", 1), ("the", 3)]
    assert result.records_in == 4
    assert result.dead_letters == 0


def test_undecodable_json_lines_become_dead_letters_with_their_origin(spark, tmp_path):
    src = tmp_path / "events.jsonl"
    src.write_text('{"user": "a"}\nnot json\n{"user": "b"}\n\n{"name": "c"}\n{"broken": \n')
    dead = sinks.Collect()
    out = sinks.Collect()
    p = Pipeline("parse", dead_letters=dead)
    p.read("events", sources.JsonLines(str(src))).map("user", lambda e: e["user"]).write("o", out)
    result = p.run(session=spark, progress=False, output_dir=str(tmp_path))
    assert sorted(out.results) == ["a", "b"]
    assert result.dead_letters == 3
    by_stage = sorted(dead.results, key=lambda d: (d["stage"], d["origin"]))
    undecodable = [d for d in by_stage if d["stage"] == "events"]
    assert [d["origin"].rsplit("@", 1)[1] for d in undecodable] == ["14", "52"]
    assert all(d["error"].startswith("cannot decode as json") for d in undecodable)
    import base64

    assert base64.b64decode(undecodable[0]["raw_b64"]) == b"not json"
    [missing] = [d for d in by_stage if d["stage"] == "user"]
    assert missing["error"].startswith("KeyError: 'user'")
    assert missing["value"] == '{"name": "c"}' and missing["value_json"], "the record, as JSON"


def test_missing_field_dead_letter_names_stage_error_and_value(spark, tmp_path):
    dead = sinks.Collect()
    out = sinks.Collect()
    p = Pipeline("fields", dead_letters=dead)
    (
        p.read("s", sources.Collection([{"n": 1}, {"x": 2}, {"n": 3}]))
        .map("get-n", lambda r: r["n"] * 10)
        .write("o", out)
    )
    p.run(session=spark, progress=False, output_dir=str(tmp_path))
    assert sorted(out.results) == [10, 30]
    [letter] = dead.results
    assert letter["stage"] == "get-n"
    assert letter["error"].startswith("KeyError: 'n'")
    assert letter["value"] == '{"x": 2}'


def test_on_error_fail_stops_the_run_with_the_cause(spark, tmp_path):
    p = Pipeline("strict", on_error="fail")
    (
        p.read("s", sources.Collection([1, 0, 2]))
        .map("invert", lambda x: 1 / x)
        .write("o", sinks.Collect())
    )
    with pytest.raises(RunError, match="ZeroDivisionError"):
        p.run(session=spark, progress=False, output_dir=str(tmp_path))


def test_oversized_and_unencodable_values_are_dead_letters(spark, tmp_path):
    dead = sinks.Collect()
    out = sinks.Collect()
    p = Pipeline("sizes", dead_letters=dead, max_record_bytes=100)
    (
        p.read("s", sources.Collection([1, 2, 3]))
        .map("blow-up", lambda x: "x" * 500 if x == 2 else (object() if x == 3 else x))
        .write("o", out)
    )
    result = p.run(session=spark, progress=False, output_dir=str(tmp_path))
    assert out.results == [1]
    reasons = sorted(d["error"] for d in dead.results)
    assert "limit is 100" in reasons[0] or "limit is 100" in reasons[1]
    assert any("cannot encode a value of type 'object'" in r for r in reasons)
    assert result.dead_letters == 2


def test_default_dead_letters_go_to_a_json_lines_file(spark, tmp_path):
    p = Pipeline("default-dlq")
    p.read("s", sources.Collection([1, 0])).map("inv", lambda x: 1 // x).write("o", sinks.Collect())
    result = p.run(session=spark, progress=False, output_dir=str(tmp_path))
    path = tmp_path / "default-dlq" / "dead-letters.jsonl"
    [letter] = [json.loads(line) for line in path.read_text().splitlines()]
    assert letter["stage"] == "inv" and letter["error"].startswith("ZeroDivisionError")
    assert "dead-letters.jsonl" in result.summary()


def test_windows_group_by_event_time(spark, tmp_path):
    from onceflow import Pane

    out = sinks.Collect()
    p = Pipeline("windows")
    events = [
        {"k": "a", "t": 1_000},
        {"k": "a", "t": 59_000},
        {"k": "a", "t": 61_000},
        {"k": "b", "t": 2_000},
    ]
    (
        p.read("s", sources.Collection(events, timestamp=lambda e: e["t"]))
        .key_by("key", lambda e: e["k"])
        .window("minute", 60)
        .combine_per_key("n", "count")
        .write("o", out)
    )
    p.run(session=spark, progress=False, output_dir=str(tmp_path))
    got = sorted(out.results, key=lambda kv: (kv[0], kv[1].start))
    # a bounded run fires one final, on-time pane per window at the end of its input
    assert got == [
        ("a", Pane(2, 0, 60_000, "on_time", 0, True)),
        ("a", Pane(1, 60_000, 120_000, "on_time", 0, True)),
        ("b", Pane(1, 0, 60_000, "on_time", 0, True)),
    ]


def test_summary_counts_records_per_stage(spark, tmp_path):
    p = Pipeline("summary")
    (
        p.read("s", sources.Generate(1000, lambda i: i % 7))
        .filter("odd", lambda x: x % 2)
        .write("o", sinks.Collect())
    )
    result = p.run(session=spark, progress=False, output_dir=str(tmp_path))
    assert result.records_in == 1000
    [(name, n_in, n_out, dead, dups)] = result.stage_rows()
    assert (name, n_in, dead, dups) == ("s", 1000, 0, 0)
    assert n_out == sum(1 for i in range(1000) if (i % 7) % 2)
    assert "records in: 1,000" in result.summary()


def test_mean_min_max_and_user_combine_fn(spark, tmp_path):
    from onceflow.pipeline.combiners import CombineFn

    class Spread(CombineFn):
        def create(self):
            return [None, None]

        def add(self, acc, v):
            lo, hi = acc
            return [v if lo is None else min(lo, v), v if hi is None else max(hi, v)]

        def merge(self, a, b):
            vals = [x for x in a + b if x is not None]
            return [min(vals), max(vals)] if vals else [None, None]

        def extract(self, acc):
            return acc[1] - acc[0]

    data = list(range(25))
    results = {}
    p = Pipeline("stats")
    keyed = p.read("s", sources.Collection(data)).key_by("k", lambda x: x % 2)
    for name, comb in [("mean", "mean"), ("min", "min"), ("max", "max"), ("spread", Spread())]:
        results[name] = sinks.Collect()
        keyed.combine_per_key(name, comb).write(f"o-{name}", results[name])
    p.run(session=spark, progress=False, output_dir=str(tmp_path))
    assert sorted(results["mean"].results) == [(0, 12.0), (1, 12.0)]
    assert sorted(results["min"].results) == [(0, 0), (1, 1)]
    assert sorted(results["max"].results) == [(0, 24), (1, 23)]
    assert sorted(results["spread"].results) == [(0, 24), (1, 22)]


@pytest.mark.parametrize("rules", [None, ()], ids=["fused", "every-node-a-stage"])
def test_dataclasses_and_named_tuples_cross_every_boundary_as_themselves(spark, tmp_path, rules):
    # the classes live in a pipeline file (module __onceflow__): no worker can import them
    from onceflow.cli.loader import load_pipeline

    here = os.path.dirname(os.path.dirname(__file__))
    p = load_pipeline(os.path.join(here, "e2e_pipelines", "records.py"))
    result = p.run(session=spark, progress=False, output_dir=str(tmp_path), rules=rules)
    assert result.dead_letters == 0
    out = {
        n.name: n.connector.results
        for n in p.graph.nodes
        if isinstance(getattr(n, "connector", None), sinks.Collect)
    }
    visits = out["visits"]
    assert sorted(v.ms for v in visits) == list(range(30))
    assert {type(v).__name__ for v in visits} == {"Visit"} and visits[0].user == visits[0][0]
    per_user = dict(out["per-user"])
    assert sorted(per_user) == ["u0", "u1", "u2"]
    clicks = [c for cs in per_user.values() for c in cs]
    assert {type(c).__name__ for c in clicks} == {"Click"}
    assert sorted(c.ms for c in clicks) == list(range(30))
    assert all(c.user == user for user, cs in per_user.items() for c in cs)


@pytest.mark.parametrize("rules", [None, ()], ids=["fused", "every-node-a-stage"])
def test_user_code_reads_and_sets_event_time(spark, tmp_path, rules):
    from datetime import UTC, datetime

    from onceflow import Pane

    lines = [
        {"k": "a", "at": "2026-01-01T00:00:01+00:00", "paid": 130_000},
        {"k": "a", "at": "2026-01-01T00:00:02+00:00", "paid": 10_000},
        {"k": "b", "at": "2026-01-01T00:00:03+00:00", "paid": 70_000},
        {"k": "b", "at": "yesterday", "paid": 1},  # no event time: a dead letter
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    base = int(datetime(2026, 1, 1, tzinfo=UTC).timestamp() * 1000)
    seen, paid, dead = sinks.Collect(), sinks.Collect(), sinks.Collect()
    p = Pipeline("event-time", dead_letters=dead)
    src = p.read(
        "in", sources.JsonLines(str(path), timestamp=lambda e: datetime.fromisoformat(e["at"]))
    )
    (
        src.restamp("by-payment", lambda e: base + e["paid"])
        .map_timestamped("check", lambda e, ts: {**e, "ts": ts - base})
        .key_by("key", lambda e: e["k"])
        .window("minute", 60)
        .combine_per_key("n", "count")
        .write("paid", paid)
    )
    # a sibling after the restamp: it must see the source's time, not the new one
    src.map_timestamped("read-time", lambda e, ts: (e["k"], ts - base)).write("seen", seen)
    p.run(session=spark, progress=False, output_dir=str(tmp_path), rules=rules)
    assert sorted(seen.results) == [("a", 1000), ("a", 2000), ("b", 3000)]
    got = sorted(paid.results, key=lambda kv: (kv[0], kv[1].start))
    assert [(k, pane.value, pane.start - base) for k, pane in got] == [
        ("a", 1, 0),
        ("a", 1, 120_000),
        ("b", 1, 60_000),
    ]
    assert all(isinstance(pane, Pane) for _k, pane in got)
    assert [d["error"].split(":")[0] for d in dead.results] == ["no event time"]

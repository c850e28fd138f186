"""A join whose sides are keyed by different types pairs nothing: it is refused, never silent.

``"u1"`` never equals ``b"u1"``: a stream keyed by text joined with a table keyed by a Kafka
key's raw bytes (``KafkaSource(envelope=True)`` without a ``key_codec``) gave every value a
None row, with no error and no dead letter (issue 42, the example of docs/guide/joins.md).
"""

from __future__ import annotations

import pytest

from onceflow import Pipeline, sinks, sources
from onceflow.pipeline.errors import PipelineError
from onceflow.runtime.errors import RunError
from onceflow.testing import run_test

CLICKS = [{"user": "u1", "page": "/a", "ts": 1_000}, {"user": "u2", "page": "/b", "ts": 2_000}]
USERS = [{"key": b"u1", "value": {"name": "Ann"}, "ts": 0}]  # as an envelope source gives them


def _clicks_with_users(users_key=lambda r: r["key"], how="left") -> Pipeline:
    p = Pipeline("clicks-users")
    users = (
        p.read("users", sources.Collection([]))
        .key_by("user-id", users_key)
        .map_values("row", lambda r: r["value"])
    )
    clicks = p.read("clicks", sources.Collection([])).key_by("by-user", lambda c: c["user"])
    clicks.join_table("with-user", users, how=how).write("out", sinks.Collect())
    return p


def test_a_table_keyed_by_bytes_and_a_stream_by_text_stop_the_run_with_one_line():
    with pytest.raises(RunError) as err:
        run_test(_clicks_with_users(), {"users": USERS, "clicks": CLICKS})
    line = str(err.value)
    assert "join_table 'with-user'" in line
    assert (
        "the stream 'by-user' is keyed by str ('u1') but the table 'row' by bytes (b'u1')" in line
    )
    assert "key_codec='utf-8'" in line


def test_keyed_alike_the_same_join_pairs_every_click():
    out = run_test(
        _clicks_with_users(lambda r: r["key"].decode()), {"users": USERS, "clicks": CLICKS}
    )
    assert sorted(out["out"]) == [
        ("u1", (CLICKS[0], {"name": "Ann"})),
        ("u2", (CLICKS[1], None)),
    ]
    assert out.dead_letters == []


def _windowed(kind: str) -> Pipeline:
    p = Pipeline("windowed-kinds")
    a = p.read("a", sources.Collection([])).key_by("ka", lambda e: e["k"])
    b = p.read("b", sources.Collection([])).key_by("kb", lambda e: e["k"].encode())
    if kind == "interval":
        a.interval_join("pairs", b, -5, 5).write("out", sinks.Collect())
    else:
        a.join("pairs", b, 60, how="left").write("out", sinks.Collect())
    return p


@pytest.mark.parametrize("kind", ["windowed", "interval"])
def test_other_joins_refuse_unlike_keys_too(kind):
    events = [{"k": "x", "t": 1_000}, {"k": "y", "t": 2_000}]
    with pytest.raises(RunError, match="'ka' is keyed by str .* but 'kb' by bytes"):
        run_test(_windowed(kind), {"a": events, "b": events})


def user_of_click(click) -> str:
    return click["user"]


def user_of_row(row) -> bytes:
    return row["key"]


def test_key_functions_that_say_their_types_are_checked_when_the_pipeline_is_built():
    p = Pipeline("declared")
    users = p.read("users", sources.Collection([])).key_by("user-id", user_of_row)
    clicks = p.read("clicks", sources.Collection([])).key_by("by-user", user_of_click)
    with pytest.raises(
        PipelineError, match="the stream 'page' is keyed by str and the table 'user-id' by bytes"
    ):
        clicks.map_values("page", lambda c: c["page"]).join_table("with-user", users)

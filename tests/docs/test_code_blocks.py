"""Every Python block in the docs and the README runs, and the whole pipelines give the output
their page says (issue 42: the `join_table` example once joined nothing, silently).

A block runs as written, after a short prelude of what its page has defined around it (a
fragment's ``orders`` or ``p``); the table below names each block by page and position, so a
new block without an entry fails :func:`test_every_block_has_an_entry`. A block that is a
whole pipeline is then run with ``run_test`` on a few records and its output checked; the
join example also on Spark with a real Redis. Blocks that only show a setting or a signature
build what they show (a pipeline, a stage, a sink), which is checked too.
"""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from onceflow import KafkaSource, Pipeline
from onceflow.testing import TestStream, assert_that, run_test

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
ORDERS_EXAMPLE = (ROOT / "examples" / "orders.py").read_text()


def blocks() -> dict[str, str]:
    """``page:n`` -> the n-th Python block of the page (snippet includes left out)."""
    out: dict[str, str] = {}
    for page in PAGES:
        found = [b for b in _BLOCK.findall(page.read_text()) if not b.startswith("--8<--")]
        for n, block in enumerate(found):
            out[f"{page.relative_to(ROOT)}:{n}"] = block
    return out


@dataclass
class Entry:
    """How a block runs: the prelude of names its page gives it, then a check of what it made."""

    prelude: str = ""
    check: Callable[[dict[str, Any]], None] | None = None


# -- checks ----------------------------------------------------------------------------------


def order(n: int, customer: str, cents: int, status: str = "paid") -> dict[str, Any]:
    return {"event_id": f"e{n}", "customer": customer, "amount": cents, "status": status, "ts": n}


def the_orders_example(ns: dict[str, Any]) -> None:
    """README, docs/index.md and the guide show examples/orders.py (tested in test_tutorial)."""
    body = ORDERS_EXAMPLE[ORDERS_EXAMPLE.index("from onceflow") :]
    assert ns["__block__"].removeprefix("# orders.py\n") == body
    out = run_test(ns["pipeline"], {"orders": [order(1, "c1", 10), order(1, "c1", 10)]})
    assert_that(out["revenue-out"]).contains_exactly([("c1", 10)])


def built(kind: type, name: str = "") -> Callable[[dict[str, Any]], None]:
    """The block made an object of ``kind`` (named ``name``, if given)."""

    def check(ns: dict[str, Any]) -> None:
        made = [v for k, v in ns.items() if isinstance(v, kind) and not k.startswith("_")]
        assert made, f"no {kind.__name__} made"
        if name:
            assert name in [getattr(m, "name", None) for m in made], made

    return check


def stages(*names: str) -> Callable[[dict[str, Any]], None]:
    """The block added these stages to the pipeline its prelude made (``p``), and it plans."""

    def check(ns: dict[str, Any]) -> None:
        pipeline = ns["p"]
        made = set(pipeline._nodes)  # noqa: SLF001 - a fragment may have no sink to plan with
        assert set(names) <= made, f"stages {set(names) - made} not in {sorted(made)}"
        if any(node.kind == "sink" for node in pipeline._nodes.values()):  # noqa: SLF001
            pipeline.plan()

    return check


def orders_and_payments(ns: dict[str, Any], mode: str = "memory") -> None:
    """A windowed left join: a paid order is paired, an unpaid one paired with None."""
    inputs = {
        "orders": [{"order_id": 1, "ts": 1_000}, {"order_id": 2, "ts": 2_000}],
        "payments": [{"order_id": 1, "ts": 60_000}],
    }
    out = run_test(ns["p"], inputs, mode=mode)
    paid = sorted((row["order"]["order_id"], row["paid"]) for row in out["out"])
    assert paid == [(1, True), (2, False)], out["out"]


def users_table(ns: dict[str, Any]) -> None:
    """Clicks enriched with the user's row as of the click; a tombstone deletes the user."""
    users = (
        TestStream()
        .add_timestamped([({"key": "u1", "value": {"name": "Ann"}}, 0)])
        .add_timestamped([({"key": "u2", "value": {"name": "Bob"}}, 0)])
        .add_timestamped([({"key": "u2", "value": None}, 5_000)])
        .advance_watermark(60_000)
    )
    clicks = [{"user": "u1", "ts": 1_000}, {"user": "u2", "ts": 2_000}, {"user": "u2", "ts": 9_000}]
    out = run_test(ns["p"], {"users": users, "clicks": clicks})
    got = sorted((k, c["ts"], row and row["name"]) for k, (c, row) in out["out"])
    assert got == [("u1", 1_000, "Ann"), ("u2", 2_000, "Bob"), ("u2", 9_000, None)], got


def click_pages(ns: dict[str, Any]) -> None:
    """Records as dataclasses: each user's list of Click, whole."""
    lines = ['{"user": "u1", "page": "/a", "ms": 1}', '{"user": "u1", "page": "/b", "ms": 2}']
    ((user, pages),) = run_test(ns["p"], {"in": lines})["out"]
    assert user == "u1" and sorted(c.page for c in pages) == ["/a", "/b"], pages


def spread(ns: dict[str, Any]) -> None:
    p = Pipeline("docs-spread")
    (
        p.read("in", ns["sources"].Collection([("k", 3), ("k", 10), ("k", 4), ("j", 1)]))
        .key_by("k", lambda kv: kv[0])
        .map_values("v", lambda kv: kv[1])
        .combine_per_key("spread", ns["Spread"]())
        .write("out", ns["KafkaSink"]("spread"))
    )
    assert_that(run_test(p)["out"]).contains_exactly([("k", 7), ("j", 0)])


def landing_totals(ns: dict[str, Any]) -> None:
    """The watched-folder example sums per user; a line delivered again (same ID) is a copy."""
    line = {"event_id": "e1", "user": "u1", "amount": 5, "ts": 1}
    later = {"event_id": "e2", "user": "u1", "amount": 2, "ts": 2}
    out = run_test(ns["pipeline"], {"landing": [line, line, later]})
    assert_that(out["totals"]).contains_exactly([("u1", 7)])


def crash_test(ns: dict[str, Any]) -> None:
    """The crash-and-resume test the page shows, run where its ``orders.py`` is."""
    import os
    import shutil
    import tempfile

    here = os.getcwd()
    folder = tempfile.mkdtemp(prefix="onceflow-docs-crash-")
    shutil.copy(ROOT / "examples" / "orders.py", folder)
    try:
        os.chdir(folder)
        ns["test_revenue_survives_a_kill_at_the_end_of_a_micro_batch"]()
    finally:
        os.chdir(here)
        shutil.rmtree(folder, ignore_errors=True)


def clicks_windows(ns: dict[str, Any]) -> None:
    clicks = TestStream().add(
        [{"user": "ann", "ts": 1_000}, {"user": "ann", "ts": 2_000}, {"user": "bob", "ts": 61_000}]
    )
    out = run_test(ns["pipeline"], {"clicks": clicks.advance_watermark(30 * 60_000)})
    assert_that(out["per-minute"]).has_final_results(
        {("ann", 0, 60_000): 2, ("bob", 60_000, 120_000): 1}
    )


# -- the blocks ------------------------------------------------------------------------------

ORDERS_PRELUDE = ORDERS_EXAMPLE[ORDERS_EXAMPLE.index("from onceflow") :]
KEYED = "p = Pipeline('docs-sinks')\ntotals = p.read('in', KafkaSource('in')).key_by('k', len)\n"
FRAGMENT = "from onceflow import *\nfrom onceflow import sinks, sources\n"


def users_copy(ns: dict[str, Any]) -> None:
    """The change data capture example: a table's rows, a delete removing one."""
    from onceflow import Change

    def change(op: str, key: int, after: dict[str, Any] | None, t: int) -> Change:
        return Change(op, "public.users", {"id": key}, None, after, t, f"lsn={t}")

    one, two = {"id": 1, "name": "a"}, {"id": 2, "name": "b"}
    changes = [change("read", 1, one, 1), change("insert", 2, two, 2), change("delete", 1, None, 3)]
    out = run_test(ns["pipeline"], {"changes": changes})
    assert_that(out["topic"]).contains_exactly([(1, one), (2, two), (1, None)])
    assert_that(out["table"]).contains_exactly([(1, one), (2, two), (1, None)])


def orders_with_users(ns: dict[str, Any]) -> None:
    """A user's row as of each order: none once deleted, the new one once inserted again."""
    from onceflow import Change

    def change(op: str, after: dict[str, Any] | None, t: int) -> tuple[Change, int]:
        return Change(op, "public.users", {"id": 7}, None, after, t, f"lsn={t}"), t

    ann, again = {"id": 7, "name": "Ann"}, {"id": 7, "name": "Ann B."}
    changes = [change("insert", ann, 1_000), change("delete", None, 3_000)]
    users = TestStream().add_timestamped([*changes, change("insert", again, 5_000)])
    orders = [{"order": n, "user_id": 7, "ts": t} for n, t in [(1, 2_000), (2, 4_000), (3, 6_000)]]
    inputs = {"users": users.advance_watermark_to_end(), "orders": orders}
    out = run_test(ns["pipeline"], inputs)
    got = sorted((o["order"], row) for _user, (o, row) in out["out"])
    assert got == [(1, ann), (2, None), (3, again)], got


ENTRIES: dict[str, Entry] = {
    "docs/guide/cdc.md:0": Entry(check=users_copy),
    "docs/guide/cdc.md:1": Entry(check=orders_with_users),
    "docs/guide/cdc.md:2": Entry(check=built(Pipeline, "users-direct")),
    "README.md:0": Entry(check=the_orders_example),
    "docs/index.md:0": Entry(check=the_orders_example),
    "docs/guide/pipelines.md:0": Entry(check=the_orders_example),
    "docs/concepts/dedup.md:0": Entry(check=built(Pipeline, "orders")),
    "docs/concepts/event-time.md:0": Entry(check=built(Pipeline, "clicks")),
    "docs/guide/configuration.md:0": Entry(check=built(Pipeline, "orders")),
    "docs/guide/joins.md:0": Entry(check=orders_and_payments),
    "docs/guide/joins.md:1": Entry(
        FRAGMENT
        + "p = Pipeline('docs-interval')\n"
        + "orders_by_id = p.read('o', KafkaSource('o')).key_by('oid', lambda o: o['id'])\n"
        + "payments_by_order = p.read('x', KafkaSource('x')).key_by('xid', lambda x: x['id'])\n",
        stages("paid-in-time"),
    ),
    "docs/guide/joins.md:2": Entry(
        FRAGMENT
        + "p = Pipeline('docs-table')\n"
        + "clicks = p.read('clicks', KafkaSource('clicks', timestamp=lambda c: c['ts']))\n",
        users_table,
    ),
    "docs/guide/pipelines.md:1": Entry(
        FRAGMENT
        + "import json\nfrom dataclasses import dataclass\n"
        + "p = Pipeline('docs-clicks')\nsource = KafkaSource('in', codec='utf-8')\n"
        + "sink = KafkaSink('pages')\n",
        click_pages,
    ),
    "docs/guide/pipelines.md:2": Entry(FRAGMENT, spread),
    "docs/guide/sources-sinks.md:0": Entry(check=built(KafkaSource)),
    "docs/guide/sources-sinks.md:1": Entry(check=landing_totals),
    "docs/guide/sources-sinks.md:2": Entry(
        FRAGMENT + ORDERS_PRELUDE + "p = pipeline\n", stages("lake")
    ),
    "docs/guide/sources-sinks.md:3": Entry(FRAGMENT + KEYED, stages("db")),
    "docs/guide/state.md:0": Entry(
        FRAGMENT
        + "p = Pipeline('docs-state')\nstream = p.read('in', KafkaSource('in'))\noutput = {}\n",
        stages("rule"),
    ),
    "docs/testing.md:0": Entry(check=crash_test),
    "docs/guide/windows.md:0": Entry(check=clicks_windows),
    "docs/guide/windows.md:1": Entry(
        FRAGMENT
        + "p = Pipeline('docs-hours')\n"
        + "per_user = p.read('clicks', KafkaSource('clicks')).key_by('u', lambda c: c['user'])"
        + ".map_values('one', lambda c: 1)\n",
        stages("per-hour"),
    ),
    "docs/guide/windows.md:2": Entry(
        FRAGMENT
        + "from onceflow.sources import JsonLines\np = pipeline = Pipeline('docs-stamps')\n",
        stages("paid-per-hour"),
    ),
    "docs/guide/writing-sinks.md:0": Entry(
        "from onceflow.connectors.base import TransactionalWriter\n",
        built(type),
    ),
}


def test_every_block_has_an_entry() -> None:
    found = blocks()
    assert len(found) >= 18, sorted(found)
    assert sorted(found) == sorted(ENTRIES), "a docs block without an entry here, or gone"


@pytest.mark.parametrize("where", sorted(ENTRIES))
def test_a_docs_block_runs_and_gives_what_its_page_says(where: str) -> None:
    entry = ENTRIES[where]
    with block_module(where) as ns:
        if entry.check is not None:
            entry.check(ns)


@pytest.mark.spark
@pytest.mark.redis
def test_the_join_example_gives_the_same_on_spark_with_redis(spark: Any) -> None:
    with block_module("docs/guide/joins.md:0") as ns:
        orders_and_payments(ns, mode="spark")


@contextmanager
def block_module(where: str) -> Iterator[dict[str, Any]]:
    """The block run, after its prelude, in a module of its own, as a user's file is (a
    dataclass looks its module up); the module's namespace."""
    block = blocks()[where]
    module = types.ModuleType("docs_block_" + re.sub(r"\W", "_", where))
    ns: dict[str, Any] = module.__dict__
    ns["__block__"] = block
    sys.modules[module.__name__] = module
    try:
        exec(compile(ENTRIES[where].prelude, f"<prelude of {where}>", "exec"), ns)  # noqa: S102
        exec(compile(block, where, "exec"), ns)  # noqa: S102 - the docs' own code
        yield ns
    finally:
        del sys.modules[module.__name__]

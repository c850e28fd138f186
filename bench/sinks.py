"""Each exactly-once sink's throughput beside the Kafka sink's, on the same input, in one run.

The pipeline reads the benchmarks' bids (see ``bench/exactly_once.py``, IDs from each bid's
``n``), converts the price (a ``map``) and writes every bid to one sink: a transactional Kafka
topic (the baseline), Parquet files (partitioned by auction modulo 10), JSON-lines files, a
PostgreSQL table (Debian's server, started here) or an Iceberg table (pyiceberg's SQL catalog on
SQLite, partitioned as the Parquet files). Exactly-once, ``--repeat`` rounds, sinks in
a rotating order, one Spark session (after one warm-up run that is not counted). After each
run an outside reader (a ``read_committed`` consumer, pyarrow, a file read, a psycopg query,
pyiceberg's scan) counts the records in the sink: a run that lost or doubled one says so in the
table.

Prints records/s (whole run, and steady state without the query's first micro-batch), median
and spread over the rounds, and the ratio to the Kafka sink's.

    python bench/sinks.py [--records 100000] [--batch 25000] [--repeat 2]
        [--sinks kafka,parquet,jsonl,postgres,iceberg] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import page  # noqa: E402
from exactly_once import produce_bids, services  # noqa: E402

from onceflow import EventTime, KafkaSink, KafkaSource, Pipeline  # noqa: E402
from onceflow.connectors.kafka.connection import KafkaSettings  # noqa: E402
from onceflow.connectors.kafka.topics import read_topic  # noqa: E402
from onceflow.connectors.postgres import PostgresSink  # noqa: E402
from onceflow.runtime.spark_env.session import DEFAULT_MASTER, spark_session  # noqa: E402
from onceflow.sinks import Iceberg, JsonLines, Parquet  # noqa: E402
from onceflow.testing.postgres import PASSWORD, LocalPostgres  # noqa: E402

SINKS = ("kafka", "parquet", "jsonl", "postgres", "iceberg")
ICEBERG_TABLE = "bench.bids"


def iceberg_catalog(folder: str) -> dict[str, str]:
    """A SQL catalog on SQLite and a warehouse folder (one per run)."""
    os.makedirs(os.path.join(folder, "warehouse"), exist_ok=True)
    return {
        "type": "sql",
        "uri": f"sqlite:///{os.path.join(folder, 'catalog.db')}",
        "warehouse": f"file://{os.path.join(folder, 'warehouse')}",
    }


def iceberg_column(folder: str) -> list[int]:
    """Every row's ``n``, read by pyiceberg's scan (not the sink's code)."""
    from pyiceberg.catalog import load_catalog

    table = load_catalog("default", **iceberg_catalog(folder)).load_table(ICEBERG_TABLE)
    return table.scan(selected_fields=("n",)).to_arrow()["n"].to_pylist()


def sink_of(kind: str, name: str, workdir: str, pg: LocalPostgres | None) -> tuple[Any, str]:
    """The sink of one run and where it writes."""
    if kind == "kafka":
        return KafkaSink(f"{name}-out"), f"{name}-out"
    if kind == "parquet":
        folder = os.path.join(workdir, name, "parquet")
        return Parquet(folder, partition_by=["shard"]), folder
    if kind == "jsonl":
        folder = os.path.join(workdir, name, "jsonl")
        return JsonLines(folder), folder
    if kind == "iceberg":
        folder = os.path.join(workdir, name, "iceberg")
        catalog = iceberg_catalog(folder)
        return Iceberg(ICEBERG_TABLE, catalog=catalog, partition_by=["shard"]), folder
    assert pg is not None
    table = name.replace("-", "_")
    import psycopg

    with psycopg.connect(pg.conninfo, password=PASSWORD, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {table} (n bigint, user_name text, auction int, price float8, "
            "ts bigint, shard int)"
        )
    conninfo = pg.conninfo
    return PostgresSink(table, conninfo=conninfo, connection={"password": PASSWORD}), table


def count_in(kind: str, where: str, bootstrap: str, pg: LocalPostgres | None) -> int:
    """Records in the sink, as a reader outside Onceflow sees them (distinct bids)."""
    if kind == "kafka":
        return len({json.loads(r.value)["n"] for r in read_topic(KafkaSettings(bootstrap), where)})
    if kind == "parquet":
        import pyarrow.dataset as ds

        return len(
            set(ds.dataset(where, format="parquet").to_table(columns=["n"])["n"].to_pylist())
        )
    if kind == "iceberg":
        return len(set(iceberg_column(where)))
    if kind == "jsonl":
        seen: set[int] = set()
        for name in os.listdir(where):
            if name.startswith("part-"):
                with open(os.path.join(where, name), encoding="utf-8") as fh:
                    seen.update(json.loads(line)["value"]["n"] for line in fh if line.strip())
        return len(seen)
    import psycopg

    assert pg is not None
    with psycopg.connect(pg.conninfo, password=PASSWORD) as conn:
        return int(conn.execute(f"SELECT count(DISTINCT n) FROM {where}").fetchone()[0])


def rows_in(kind: str, where: str, bootstrap: str, pg: LocalPostgres | None) -> int:
    """All rows in the sink (a copy counts): must equal the distinct count."""
    if kind == "postgres":
        import psycopg

        assert pg is not None
        with psycopg.connect(pg.conninfo, password=PASSWORD) as conn:
            return int(conn.execute(f"SELECT count(*) FROM {where}").fetchone()[0])
    if kind == "kafka":
        return len(read_topic(KafkaSettings(bootstrap), where))
    if kind == "iceberg":
        return len(iceberg_column(where))
    if kind == "parquet":
        import pyarrow.dataset as ds

        return ds.dataset(where, format="parquet").count_rows()
    total = 0
    for name in os.listdir(where):
        if name.startswith("part-"):
            with open(os.path.join(where, name), encoding="utf-8") as fh:
                total += sum(1 for line in fh if line.strip())
    return total


def run_once(
    spark: Any, kind: str, args: argparse.Namespace, env: dict[str, Any]
) -> dict[str, Any]:
    name = f"sinks-{kind}-{uuid.uuid4().hex[:6]}"
    sink, where = sink_of(kind, name, env["workdir"], env["pg"])
    p = Pipeline(name, event_time=EventTime.of(out_of_orderness="1s"))
    p.read("bids", KafkaSource(env["topic"], timestamp=lambda b: b["ts"], id=lambda b: b["n"])).map(
        "euros",
        lambda b: {
            "n": b["n"],
            "user_name": b["user"],
            "auction": b["auction"],
            "price": b["price"] * 0.908,
            "ts": b["ts"],
            "shard": b["auction"] % 10,
        },
    ).write("out", sink)
    started = time.perf_counter()
    result = p.run(
        session=spark,
        redis_url=env["redis_url"],
        available_now=True,
        max_records_per_batch=args.batch,
        checkpoint=os.path.join(env["workdir"], name, "ckpt"),
        output_dir=os.path.join(env["workdir"], name),
        progress=False,
    )
    seconds = time.perf_counter() - started
    distinct = count_in(kind, where, env["bootstrap"], env["pg"])
    rows = rows_in(kind, where, env["bootstrap"], env["pg"])
    history = result.extra["history"][1:]
    steady_n = sum(n for _, n, _ in history)
    steady_s = sum(s for _, _, s in history)
    return {
        "sink": kind,
        "rate": args.records / seconds,
        "steady": steady_n / steady_s if steady_s else 0.0,
        "exact": distinct == args.records and rows == args.records,
        "found": (distinct, rows),
    }


def table(runs: dict[str, list[dict[str, Any]]], records: int) -> list[str]:
    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    def spread(kind: str, key: str) -> str:
        values = [r[key] for r in runs[kind]]
        return f"{min(values):,.0f}–{max(values):,.0f}"

    lines = [
        f"{records:,} bids, exactly-once, {len(next(iter(runs.values())))} run(s) per sink",
        "",
        "| sink | records/s (whole run) | spread | steady records/s | vs Kafka sink | exact |",
        "|---|---|---|---|---|---|",
    ]
    base = med("kafka", "rate") if "kafka" in runs else None
    for kind, rs in runs.items():
        ratio = f"{med(kind, 'rate') / base:.0%}" if base else "-"
        exact = "yes" if all(r["exact"] for r in rs) else f"NO {[r['found'] for r in rs]}"
        lines.append(
            f"| {kind} | {med(kind, 'rate'):,.0f} | {spread(kind, 'rate')} | "
            f"{med(kind, 'steady'):,.0f} | {ratio} | {exact} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=25_000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--sinks", default=",".join(SINKS))
    ap.add_argument("--markdown", help="also write the table to this file")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.sinks.split(",") if k.strip()]
    with contextlib.ExitStack() as stack:
        redis_url, bootstrap, _ = stack.enter_context(services(False))
        os.environ["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap  # the sources and sinks find it there
        pg = None
        if "postgres" in kinds:
            pg = LocalPostgres().start()
            stack.callback(pg.stop)
        workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="onceflow-sinks-"))
        topic = f"sinks-bids-{uuid.uuid4().hex[:6]}"
        produce_bids(KafkaSettings(bootstrap), topic, args.records)
        env = {"redis_url": redis_url, "bootstrap": bootstrap, "pg": pg, "workdir": workdir}
        env["topic"] = topic
        spark = spark_session(DEFAULT_MASTER, app_name="onceflow-bench-sinks")
        run_once(spark, kinds[0], args, env)  # warm-up, not counted: the JVM's first query
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        for round_ in range(args.repeat):
            order = kinds[round_ % len(kinds) :] + kinds[: round_ % len(kinds)]
            for kind in order:
                r = run_once(spark, kind, args, env)
                runs[kind].append(r)
                print(f"round {round_ + 1} {kind}: {r['rate']:,.0f} records/s", flush=True)
        lines = table(runs, args.records)
        print("\n".join(lines))
        if args.markdown:
            command = (
                f"Generated by `python bench/sinks.py --records {args.records} --batch "
                f"{args.batch} --repeat {args.repeat} --sinks {args.sinks} --markdown "
                f"{args.markdown}` on {time.strftime('%Y-%m-%d')} ({os.cpu_count()} cores, Spark "
                "`local[2]`). Each sink's records/s beside the transactional Kafka sink's, "
                "exactly-once, the same bids; *exact*: an outside reader found every bid once."
            )
            page.replace_section(args.markdown, "## Sinks", [command, "", *lines])


if __name__ == "__main__":
    main()

"""Operator commands of the ``onceflow`` CLI: audit, gc and status."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.kernel.errors import ConfigError, ServiceError
from onceflow.kernel.settings import RedisSettings, new_redis_client, retry_options


def cmd_audit(args: argparse.Namespace) -> int:
    """Report duplicates and gaps; exit 1 when there are conflicting copies or gaps."""
    from onceflow.operations.audit import audit

    settings = KafkaSettings.from_env(args.bootstrap_servers)
    report = audit(settings, args.topic, args.input_topic, args.match_field)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.text())
    return 0 if report.ok else 1


def operator_redis(args: argparse.Namespace, namespace: str | None = None) -> Any:
    """A client; on a Redis Cluster, of the master serving ``namespace`` (None: the cluster)."""
    settings = RedisSettings.from_env(args.redis_url)
    # An operator command fails fast (a few seconds) instead of riding out outages.
    client = new_redis_client(
        settings,
        namespace,
        **retry_options(retries=3, cap_s=1.0),
        socket_connect_timeout=5,
        socket_timeout=60,
    )
    try:
        client.ping()
    except Exception as exc:
        msg = (
            f"cannot reach Redis at {settings.url.split('@')[-1]}: {exc}. Check REDIS_URL (or "
            "--redis-url), REDIS_PASSWORD and TLS settings, and that the server is up"
        )
        raise ServiceError(msg) from exc
    return client


def tag_clients(args: argparse.Namespace) -> Any:
    """Clients of partition scopes by hash tag on a Redis Cluster; None on one Redis."""
    if not RedisSettings.from_env(args.redis_url).cluster:
        return None
    clients: dict[str, Any] = {}

    def connect(tag: str) -> Any:
        if tag not in clients:
            clients[tag] = operator_redis(args, tag)
        return clients[tag]

    return connect


def _targets(client: Any, args: argparse.Namespace) -> list[str]:
    from onceflow.operations.gc import namespaces

    if args.all:
        return namespaces(client)
    if not args.namespace:
        msg = "name a pipeline namespace (--namespace NAME) or pass --all"
        raise ConfigError(msg)
    return list(args.namespace)


def _gc_pass(args: argparse.Namespace, metrics: Any = None) -> int:
    from onceflow.kernel.durations import parse_duration_ms
    from onceflow.kernel.keyspace import Keyspace
    from onceflow.operations.gc import GcError, collect

    names = _targets(operator_redis(args), args)
    if not names:
        print(json.dumps({"event": "onceflow.gc", "namespaces": 0}), flush=True)
    failed = []
    for name in names:
        client = operator_redis(args, name)
        try:
            result = collect(
                client,
                name,
                dry_run=args.dry_run,
                horizon=args.horizon,
                scan_count=args.scan_count,
                delete_batch=args.delete_batch,
                connect=tag_clients(args),
                staging_age_s=parse_duration_ms(args.staging_age, "--staging-age") / 1000,
            )
        except GcError as exc:
            if not args.all:
                raise
            # one odd namespace must not stop the others' collection: said, and counted
            failed.append(name)
            line = {"event": "onceflow.gc.skipped", "namespace": name, "error": str(exc)}
            print(json.dumps(line), file=sys.stderr, flush=True)
            continue
        print(result.log_line(), flush=True)
        if metrics is not None:
            metrics.passed(result, client.hgetall(Keyspace(name).gc))
    return 1 if failed else 0


def _observed_pass(args: argparse.Namespace, metrics: Any) -> int:
    """A pass over every namespace asked for, its metrics written (``--metrics-file``)."""
    ok = False
    code = 1
    try:
        code = _gc_pass(args, metrics)
        ok = code == 0
    finally:
        if metrics is not None:
            metrics.run_ended(ok)
            if args.metrics_file:
                metrics.write(args.metrics_file)
    return code


def _gc_metrics(args: argparse.Namespace) -> Any:
    """The GC's metrics (``--metrics-file``, ``--metrics-port`` with ``--every``), or None."""
    if args.metrics_port is not None and not args.every:
        msg = (
            "--metrics-port needs --every: a single pass ends before anything could scrape it; "
            "use --metrics-file PATH.prom (node-exporter's textfile collector) from cron"
        )
        raise ConfigError(msg)
    if not args.metrics_file and args.metrics_port is None:
        return None
    from onceflow.operations.gc_metrics import GcMetrics

    metrics = GcMetrics()
    if args.metrics_port is not None:
        url = metrics.serve(args.metrics_host, args.metrics_port)
        print(json.dumps({"event": "onceflow.gc.metrics", "url": url}), flush=True)
    return metrics


def cmd_gc(args: argparse.Namespace) -> int:
    """One pass, or a pass every ``--every``; failures say what to check."""
    metrics = _gc_metrics(args)
    try:
        if not args.every:
            return _observed_pass(args, metrics)
        return _gc_loop(args, metrics)
    finally:
        if metrics is not None:
            metrics.close()


def _gc_loop(args: argparse.Namespace, metrics: Any) -> int:
    from onceflow.kernel.durations import parse_duration_ms

    interval = parse_duration_ms(args.every) / 1000
    failures = 0
    while True:
        started = time.monotonic()
        try:
            _observed_pass(args, metrics)
            failures = 0
        except (ConfigError, ServiceError) as exc:
            failures += 1
            print(
                json.dumps(
                    {"event": "onceflow.gc.failed", "error": str(exc), "in_a_row": failures}
                ),
                file=sys.stderr,
                flush=True,
            )
            if args.max_failures and failures >= args.max_failures:
                return 1
        time.sleep(max(0.0, interval - (time.monotonic() - started)))


def cmd_reset(args: argparse.Namespace) -> int:
    """Delete a namespace's Redis state and its checkpoint, after saying what goes."""
    from onceflow.operations.reset import reset, running_message

    client = operator_redis(args, args.namespace)
    tags = tag_clients(args)
    preview = reset(client, args.namespace, args.checkpoint, dry_run=True, connect=tags)
    where = f" and the checkpoint {args.checkpoint}" if args.checkpoint else ""
    print(f"namespace {args.namespace!r}: {preview.keys:,} Redis keys{where}")
    if preview.driver is not None:
        print(f"running: {running_message(args.namespace, preview.driver)}")
    if args.dry_run:
        return 0
    if not args.yes:
        msg = (
            "this deletes the pipeline's dedup history, backups and keyed state for good; "
            "pass --yes to do it"
        )
        raise ConfigError(msg)
    done = reset(client, args.namespace, args.checkpoint, connect=tags, force=args.force)
    print(
        f"deleted {done.keys:,} keys" + (" and the checkpoint" if done.checkpoint_deleted else "")
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Text or JSON view of one or all namespaces."""
    from onceflow.operations.status import status, status_json

    statuses, refused = [], []
    for name in _targets(operator_redis(args), args):
        try:
            statuses.append(status(operator_redis(args, name), name, connect=tag_clients(args)))
        except ConfigError as exc:  # one namespace (an older build's ...) must not hide the rest
            refused.append(str(exc))
    if args.json:
        print(status_json(statuses))
    elif not statuses and not refused:
        print("no pipeline namespaces with exactly-once state in this Redis")
    else:
        print("\n\n".join(s.text() for s in statuses))
    for reason in refused:
        print(f"error: {reason}", file=sys.stderr)
    return 2 if refused else 0


def cmd_dead_letters_replay(args: argparse.Namespace) -> int:
    """Send a pipeline's dead letters back through it (see :mod:`onceflow.operations.redrive`)."""
    from onceflow.cli.loader import load_pipeline
    from onceflow.operations.redrive import replay

    pipeline = load_pipeline(args.file, args.pipeline)
    namespace = args.namespace or pipeline.name
    found = replay(
        pipeline,
        pipeline.plan(),  # a run's default rules: which nodes a source's stage runs
        operator_redis(args, namespace),
        codes=tuple(args.code or ()),
        dry_run=args.dry_run,
        namespace=namespace,
    )
    print(found.text())
    if not args.dry_run and found.sends:
        print(f"sent {len(found.sends)}: the running (or next) run of the pipeline reads them")
    return 0


def cmd_dead_letters_show(args: argparse.Namespace) -> int:
    """Print a pipeline's dead letters readably (see :mod:`onceflow.operations.letters`)."""
    from onceflow.operations import letters

    if args.file.endswith((".jsonl", ".json")):
        try:
            with open(args.file, encoding="utf-8") as fh:
                found = letters.from_json_lines(fh, args.file)
        except OSError as exc:
            msg = f"cannot read dead letters from {args.file}: {exc.strerror or exc}"
            raise ConfigError(msg) from None
    else:
        from onceflow.cli.loader import load_pipeline
        from onceflow.connectors.kafka.topics import read_topic
        from onceflow.operations.redrive import dead_letter_topic

        topic, settings = dead_letter_topic(load_pipeline(args.file, args.pipeline))
        found = [letters.from_topic(r, topic) for r in read_topic(settings, topic)]
    shown = letters.chosen(found, tuple(args.code or ()), args.limit)
    if args.json:
        for letter in shown:
            print(json.dumps(letter))
    elif shown:
        print("\n\n".join(letters.letter_text(x) for x in shown))
    else:
        print("no dead letters" + (f" of code {', '.join(args.code)}" if args.code else ""))
    return 0


def _add_redis_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--namespace", action="append", help="pipeline namespace (default name: the pipeline's)"
    )
    p.add_argument("--all", action="store_true", help="every namespace found in this Redis")
    p.add_argument("--redis-url", help="Redis (default $REDIS_URL)")


def add_commands(sub: Any) -> None:
    """Register the operator commands on the CLI's subparsers."""
    p = sub.add_parser("audit", help="count records per ID in an output topic")
    p.add_argument("--topic", required=True, help="the output topic to audit")
    p.add_argument("--input-topic", help="compare against this input topic")
    p.add_argument(
        "--match-field",
        help="JSON field identifying a record in both topics (reports inputs with no output)",
    )
    p.add_argument("--bootstrap-servers", help="Kafka (default $KAFKA_BOOTSTRAP_SERVERS)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=cmd_audit)

    p = sub.add_parser(
        "gc",
        help="delete exactly-once state that can no longer matter",
        description="Delete seen-ID buckets older than the dedup horizon, acknowledged "
        "backups, stale Bloom snapshots and file sinks' staging leftovers. Safe while the "
        "pipeline runs. One JSON log line per namespace and pass.",
    )
    _add_redis_target_args(p)
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    p.add_argument("--every", help="run a pass every INTERVAL (e.g. 10m) until stopped")
    p.add_argument("--horizon", help="keep more than the pipeline's horizon (e.g. 48h); never less")
    p.add_argument(
        "--staging-age",
        default="1h",
        help="delete file sinks' staged files older than this (killed attempts' leftovers)",
    )
    p.add_argument("--scan-count", type=int, default=1000, help="SCAN step (keys)")
    p.add_argument("--delete-batch", type=int, default=500, help="keys per UNLINK")
    p.add_argument(
        "--max-failures",
        type=int,
        default=0,
        help="with --every: exit 1 after this many failed passes in a row (0: never)",
    )
    p.add_argument(
        "--metrics-file",
        metavar="PATH.prom",
        help="after each run, replace this file with Prometheus metrics of the passes "
        "(node-exporter's textfile collector format: what a cron-run GC needs)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="with --every: serve Prometheus metrics of the passes on this port (/metrics)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics endpoint listens on (default 127.0.0.1)",
    )
    p.set_defaults(handler=cmd_gc)

    p = sub.add_parser(
        "reset",
        help="start a pipeline over: delete its Redis namespace and its checkpoint",
        description="Delete every Redis key of a pipeline namespace and its (local) Spark "
        "checkpoint folder, so the next run starts from scratch. The two belong together: "
        "a run refuses one without the other.",
    )
    p.add_argument("--namespace", required=True, help="pipeline namespace (default: its name)")
    p.add_argument("--checkpoint", help="the pipeline's checkpoint folder")
    p.add_argument("--redis-url", help="Redis (default $REDIS_URL)")
    p.add_argument("--dry-run", action="store_true", help="say what would be deleted")
    p.add_argument("--yes", action="store_true", help="really delete")
    p.add_argument(
        "--force",
        action="store_true",
        help="delete even though a driver of the namespace says it runs (it was lost)",
    )
    p.set_defaults(handler=cmd_reset)

    p = sub.add_parser(
        "dead-letters",
        help="show dead letters, or send them back through their pipeline, exactly once",
        description="Replay a pipeline's dead letters once their cause is fixed: undecodable "
        "source records are sent again as they were, records your code failed on go back to "
        "the node they failed in. Each letter is replayed once: a later replay sends only "
        "newer letters, and a letter sent twice is dropped by the pipeline as a duplicate.",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = actions.add_parser("replay", help="replay the letters written since the last replay")
    p.add_argument("file", help="the pipeline file (as for onceflow run)")
    p.add_argument("--pipeline", help="which pipeline of the file (as for onceflow run)")
    p.add_argument(
        "--code",
        action="append",
        help="replay only letters with this reason (user_error, undecodable, ...); repeatable",
    )
    p.add_argument("--namespace", help="pipeline namespace (default: the pipeline's name)")
    p.add_argument("--redis-url", help="Redis (default $REDIS_URL)")
    p.add_argument("--dry-run", action="store_true", help="say what would be sent, send nothing")
    p.set_defaults(handler=cmd_dead_letters_replay)
    p = actions.add_parser("show", help="print the letters readably (IDs in hex, times in UTC)")
    p.add_argument(
        "file", help="the pipeline file (its dead-letter topic), or a .jsonl dead-letter file"
    )
    p.add_argument("--pipeline", help="which pipeline of the file (as for onceflow run)")
    p.add_argument("--code", action="append", help="only letters with this code; repeatable")
    p.add_argument("--limit", type=int, help="only the last N letters")
    p.add_argument("--json", action="store_true", help="one JSON object per letter")
    p.set_defaults(handler=cmd_dead_letters_show)

    p = sub.add_parser("status", help="what a pipeline's exactly-once state says")
    _add_redis_target_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=cmd_status)

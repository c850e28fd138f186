"""The ``onceflow`` command: run, explain and demo pipelines (and operate them).

Every failure Onceflow anticipates ends with one ``error:`` line saying what to check and a
non-zero exit status: 2 for a wrong command line, file or setting, 1 for a failed run.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from onceflow.cli.config import CONFIG_ENV, check_config, layered_defaults, read_config
from onceflow.cli.ops import add_commands
from onceflow.kernel.errors import ConfigError, OnceflowError
from onceflow.runtime.session import DEFAULT_LOG_LEVEL, LOG_LEVELS

Handler = Callable[[argparse.Namespace], int]


def _rules(args: argparse.Namespace) -> tuple[Any, ...] | None:
    from onceflow.graph_optimizer.optimizer import rules_by_name

    if getattr(args, "no_optimize", False):
        return ()
    if getattr(args, "rules", None):
        try:
            return rules_by_name([r.strip() for r in args.rules.split(",") if r.strip()])
        except KeyError as exc:
            raise ConfigError(str(exc.args[0])) from None
    return None


def cmd_explain(args: argparse.Namespace) -> int:
    """Print or draw the logical graph and the physical plan."""
    from onceflow.cli.loader import load_pipeline
    from onceflow.graph_optimizer.draw import explain_text, render, to_dot

    pipeline = load_pipeline(args.file, args.pipeline)
    graph = pipeline.graph
    plan = pipeline.plan(_rules(args))
    if args.format == "text":
        _emit(explain_text(graph, plan).encode() + b"\n", args.output)
        return 0
    dot = to_dot(graph, plan)
    data = dot.encode() if args.format == "dot" else render(dot, args.format)
    if args.format in ("svg", "png") and args.output is None:
        args.output = f"{pipeline.name}-plan.{args.format}"
    _emit(data, args.output)
    if args.output:
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _emit(data: bytes, path: str | None) -> None:
    if path is None or path == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    with open(path, "wb") as fh:
        fh.write(data)


def cmd_run(args: argparse.Namespace) -> int:
    """Run a pipeline file and print its summary."""
    from onceflow.cli.loader import load_pipeline

    conf = spark_conf(args)
    kafka_waits(args)
    pipeline = load_pipeline(args.file, args.pipeline)
    settings = streaming_settings(args)
    ui = _start_ui(args, pipeline)
    try:
        result = pipeline.run(
            master=args.master,
            parallelism=args.parallelism,
            rules=_rules(args),
            progress=not args.no_progress,
            output_dir=args.output_dir,
            code_dir=os.path.dirname(os.path.abspath(args.file)),
            log_level=args.log_level,
            spark_conf=conf,
            **settings,
        )
    finally:
        if ui is not None:
            ui.stop()
    print(result.summary())
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    """Serve a live page of a pipeline: its plan, with its exactly-once counters."""
    import time

    from onceflow.cli.loader import load_pipeline
    from onceflow.operations.ui import pipeline_svg, serve

    pipeline = load_pipeline(args.file, args.pipeline)
    namespace = args.namespace or pipeline.name
    svg = pipeline_svg(pipeline, _rules(args))
    try:
        server, url = serve(namespace, args.redis_url, svg, host=args.host, port=args.port)
    except OSError as exc:
        msg = f"cannot listen on {args.host}:{args.port}: {exc}; pick another --port"
        raise ConfigError(msg) from exc
    print(f"onceflow ui: {url} (namespace {namespace!r}); Ctrl-C to stop", file=sys.stderr)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.stop()


def _start_ui(args: argparse.Namespace, pipeline: Any) -> Any:
    """The live page of a run (``--ui-port``), or None."""
    if getattr(args, "ui_port", None) is None:
        return None
    from onceflow.graph_optimizer.errors import GraphError
    from onceflow.operations.ui import pipeline_svg, serve

    try:
        svg = pipeline_svg(pipeline, _rules(args))
    except GraphError:  # no Graphviz: the page works without the drawing
        svg = ""
    server, url = serve(pipeline.name, args.redis_url, svg, port=args.ui_port)
    print(f"[{pipeline.name}] live page: {url}", file=sys.stderr, flush=True)
    return server


def streaming_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Streaming options given on the command line (only those set)."""
    names = (
        "redis_url",
        "checkpoint",
        "guarantee",
        "trigger_seconds",
        "available_now",
        "max_records_per_batch",
        "allow_non_durable_redis",
        "allow_unconfirmed_fsync",
        "redis_wait_replicas",
        "redis_restarts",
        "accept_plan_change",
        "stop_after_batches",
        "metrics_port",
        "metrics_host",
        "metrics_linger",
    )
    values = {n: getattr(args, n, None) for n in names}
    return {n: v for n, v in values.items() if v is not None and v is not False}  # 0 counts


def kafka_waits(args: argparse.Namespace) -> None:
    """``--kafka-start-wait``/``--kafka-outage-wait`` for the Kafka connectors to read.

    Connectors read their settings from the environment on the driver (their waits too:
    ``ONCEFLOW_KAFKA_START_WAIT``, ``ONCEFLOW_KAFKA_OUTAGE_WAIT``), so a flag is passed on
    there, checked first.
    """
    from onceflow.kernel.durations import parse_duration_ms
    from onceflow.kernel.settings import KAFKA_OUTAGE_WAIT_ENV, KAFKA_START_WAIT_ENV

    for name, variable in (
        ("kafka_start_wait", KAFKA_START_WAIT_ENV),
        ("kafka_outage_wait", KAFKA_OUTAGE_WAIT_ENV),
    ):
        value = getattr(args, name, None)
        if value:
            flag = "--" + name.replace("_", "-")
            parse_duration_ms(value, flag)
            os.environ[variable] = value


def spark_conf(args: argparse.Namespace) -> dict[str, str]:
    """Spark settings from ``--conf spark.key=value`` (repeatable) and ``--spark-ui*``."""
    conf: dict[str, str] = {}
    for item in getattr(args, "conf", None) or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.startswith("spark.") or key == "spark.":
            msg = f"--conf takes spark.key=value (e.g. spark.executor.memory=2g), got {item!r}"
            raise ConfigError(msg)
        conf[key] = value.strip()
    port = getattr(args, "spark_ui_port", None)
    if getattr(args, "spark_ui", False) or port is not None:
        conf["spark.ui.enabled"] = "true"
        if port is not None:
            conf["spark.ui.port"] = str(port)
    return conf


def cmd_jvm_cache(args: argparse.Namespace) -> int:
    """Make the driver JVM's class-data archive (see onceflow.runtime.jvm_archive)."""
    from onceflow.runtime.jvm_archive import build

    path = build(args.force)
    print(path or "no archive: Java or PySpark not found, or ONCEFLOW_JVM_ARCHIVE=0")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The quick-start demo."""
    if args.which == "wordcount":
        return demo_wordcount(args)
    from onceflow.cli.demo.exactly_once import main as exactly_once_demo

    return exactly_once_demo(args)


def demo_wordcount(args: argparse.Namespace) -> int:
    """Bounded word count over the bundled sample: the plan, then the result."""
    from onceflow.cli.demo import wordcount
    from onceflow.graph_optimizer.draw import explain_text
    from onceflow.pipeline.sinks import Collect

    sink = Collect()
    pipeline = wordcount.build(sink=sink)
    plan = pipeline.plan()
    print(explain_text(pipeline.graph, plan))
    print()
    result = pipeline.run(
        master=args.master,
        parallelism=args.parallelism,
        progress=not args.no_progress,
        output_dir=args.output_dir,
        log_level=args.log_level,
        spark_conf=spark_conf(args),
    )
    top = sorted(sink.results, key=lambda kv: (-kv[1], kv[0]))[:15]
    print("Most frequent words:")
    for word, n in top:
        print(f"  {word:<14} {n:>4}")
    print()
    print(result.summary())
    return 0


def _add_pipeline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a Python file exposing a Pipeline (see docs)")
    p.add_argument("--pipeline", help="name of the Pipeline (or builder) in the file")
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--no-optimize",
        action="store_true",
        help="use the unoptimized plan (every node a stage of its own)",
    )
    group.add_argument("--rules", help="comma-separated optimizer rules to apply (default: all)")


def _add_spark_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--master",
        default="local[2]",
        help="Spark master URL (default local[2]; spark://host:7077 for a cluster)",
    )
    p.add_argument(
        "--parallelism",
        type=int,
        default=2,
        help="partitions per exchange (fixed for the life of a streaming pipeline)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--output-dir", default="onceflow-output", help="where default outputs (dead letters) go"
    )
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=DEFAULT_LOG_LEVEL,
        help="level of Spark's and Onceflow's log, which goes to a file (its path is printed "
        "when a run fails, or at start with a level other than warn); default warn",
    )
    p.add_argument(
        "--spark-ui",
        action="store_true",
        help="serve Spark's web UI (off by default; port 4040 or the next free one)",
    )
    p.add_argument("--spark-ui-port", type=int, help="serve Spark's web UI on this port")
    p.add_argument(
        "--conf",
        action="append",
        metavar="spark.KEY=VALUE",
        help="a Spark setting for the session (repeatable), e.g. spark.executor.memory=2g",
    )


def _add_streaming_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("streaming (pipelines with Kafka sources)")
    g.add_argument("--redis-url", help="Redis for exactly-once state (default $REDIS_URL)")
    g.add_argument(
        "--checkpoint",
        help="Spark checkpoint directory or URL of the query (default "
        "<output-dir>/<pipeline>/checkpoint, resolved against the current folder: resume "
        "from the same folder or pass an absolute path; on a cluster, a URL or path every "
        "machine shares)",
    )
    g.add_argument(
        "--guarantee",
        choices=("exactly-once", "at-least-once"),
        help="exactly-once (default) or at-least-once (no IDs, backup or dedup)",
    )
    g.add_argument("--trigger-seconds", type=float, help="micro-batch interval")
    g.add_argument(
        "--available-now", action="store_true", help="process what is in the topics now, then stop"
    )
    g.add_argument("--max-records-per-batch", type=int, help="cap on records per micro-batch")
    g.add_argument("--stop-after-batches", type=int, help="stop after this many micro-batches")
    g.add_argument(
        "--accept-plan-change",
        action="store_true",
        help="resume a namespace whose stored plan differs from this one (the dedup history "
        "of stages that changed starts over)",
    )
    g.add_argument(
        "--ui-port", type=int, help="serve a live page of the run on this port (loopback)"
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics of the run on this port (path /metrics; 0: any free port)",
    )
    g.add_argument(
        "--metrics-host",
        help="address the metrics endpoint listens on (default 127.0.0.1; 0.0.0.0 for a "
        "Prometheus on another host)",
    )
    g.add_argument(
        "--metrics-linger",
        type=float,
        help="keep serving metrics this many seconds after the run ends, for a last scrape "
        "(SIGTERM or Ctrl-C ends it sooner)",
    )
    g.add_argument(
        "--redis-wait-replicas",
        type=int,
        help="Redis replicas that must acknowledge each micro-batch before Spark commits it "
        "(default: 1 if Redis has a replica, else 0)",
    )
    g.add_argument(
        "--allow-non-durable-redis",
        action="store_true",
        help="run even if Redis persistence (AOF) is off: exactly-once is then lost "
        "when Redis restarts",
    )
    g.add_argument(
        "--allow-unconfirmed-fsync",
        action="store_true",
        help="run on a Redis before 7.2 with appendfsync everysec and no replica, which cannot "
        "confirm that a batch reached its disk: a crash of its host may then lose committed "
        "results (a later run stops and says so)",
    )
    g.add_argument(
        "--redis-restarts",
        type=int,
        help="times a micro-batch is run again when its Redis server restarted or failed over "
        "during it (default 3; 0 stops the run at the first)",
    )
    g.add_argument(
        "--kafka-start-wait",
        metavar="DURATION",
        help="how long the run waits for Kafka to answer when it starts (default 60s)",
    )
    g.add_argument(
        "--kafka-outage-wait",
        metavar="DURATION",
        help="how long a running pipeline waits for a Kafka broker that went away (a "
        "restart) before it stops (default 3m)",
    )


def version() -> str:
    """The installed distribution's version."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("onceflow")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        metavar="PATH.toml",
        help=f"a TOML file of options (default ${CONFIG_ENV}); precedence: flags, then "
        "environment variables, then this file, then built-in defaults",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``onceflow`` command."""
    parser = argparse.ArgumentParser(
        prog="onceflow",
        description="Streaming pipelines with exactly-once results on Apache Spark.",
    )
    parser.add_argument("--version", action="version", version=f"onceflow {version()}")
    _add_config_arg(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run a pipeline file")
    _add_pipeline_args(p)
    _add_spark_args(p)
    _add_streaming_args(p)
    p.set_defaults(handler=cmd_run)

    p = sub.add_parser("explain", help="print or draw a pipeline's plans")
    _add_pipeline_args(p)
    p.add_argument("--format", choices=("text", "dot", "svg", "png"), default="text")
    p.add_argument(
        "-o",
        "--output",
        help="output file (default: stdout for text/dot, <pipeline>-plan.<fmt> for svg/png)",
    )
    p.set_defaults(handler=cmd_explain)

    p = sub.add_parser("ui", help="serve a live page: the plan with the pipeline's counters")
    _add_pipeline_args(p)
    p.add_argument("--namespace", help="Redis namespace (default: the pipeline's name)")
    p.add_argument("--redis-url", help="Redis (default $REDIS_URL)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: loopback)")
    p.add_argument("--port", type=int, default=8765, help="port (0: any free port)")
    p.set_defaults(handler=cmd_ui)

    p = sub.add_parser("demo", help="run the quick-start demo")
    p.add_argument(
        "which", nargs="?", default="exactly-once", choices=("exactly-once", "wordcount")
    )
    _add_spark_args(p)
    p.add_argument("--events", type=int, default=20000, help="events to produce (exactly-once)")
    p.set_defaults(handler=cmd_demo)

    p = sub.add_parser(
        "jvm-cache",
        help="make the Spark driver's class-data archive (runs and restarts start ~1.5 s sooner)",
    )
    p.add_argument("--force", action="store_true", help="make it again")
    p.set_defaults(handler=cmd_jvm_cache)

    add_commands(sub)
    for command in sub.choices.values():
        _add_config_arg(command)
    return parser


def commands_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser of each subcommand, by name."""
    for action in parser._actions:  # noqa: SLF001 - argparse has no public accessor
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return dict(action.choices)
    return {}


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ
) -> argparse.Namespace:
    """The command line over the environment over the config file (see ``cli.config``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    path = getattr(args, "config", None) or environ.get(CONFIG_ENV) or None
    commands = commands_of(parser)
    config: dict[str, Any] = {}
    if path:
        config = read_config(path)
        check_config(config, commands, path)
    defaults = layered_defaults(args.command, commands[args.command], config, path, environ)
    if not defaults:
        return args
    commands[args.command].set_defaults(**defaults)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``onceflow`` console script."""
    try:
        args = parse_args(argv)
        handler: Handler = args.handler
        return handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ConfigError, OnceflowError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        from onceflow.runtime.errors import RunError

        return 1 if isinstance(exc, RunError) else 2


if __name__ == "__main__":
    raise SystemExit(main())

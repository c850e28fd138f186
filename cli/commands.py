"""The commands of ``onceflow`` that take a pipeline: run, explain, ui, demo and jvm-cache.

Their arguments are declared in :func:`onceflow.cli.main.build_parser`; the operator
commands are in :mod:`onceflow.cli.ops`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from onceflow.kernel.errors import ConfigError
from onceflow.runtime.driver.run_config import RunConfig, dest, flagged


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

    code_dir = os.path.dirname(os.path.abspath(args.file))
    config = run_config(args, code_dir=code_dir, spark_conf=spark_conf(args))
    kafka_waits(config)
    pipeline = load_pipeline(args.file, args.pipeline)
    config = unused_defaults_dropped(args, config, pipeline)
    ui = _start_ui(args, config, pipeline)
    try:
        result = pipeline.run(_rules(args), config=config)
    finally:
        if ui is not None:
            ui.stop()
    print(result.summary())
    return 0


def unused_defaults_dropped(
    args: argparse.Namespace, config: RunConfig, pipeline: Any
) -> RunConfig:
    """A bounded pipeline's config without the streaming settings the user did not pass.

    A setting that only a streaming run reads is refused by a bounded run when a flag gave
    it; from the environment or a config file (an exported ``REDIS_URL``) it is a default
    that does not apply: dropped, with one note.
    """
    if not all(getattr(s.connector, "bounded", False) for s in pipeline.graph.sources()):
        return config
    layered: dict[str, str] = getattr(args, "layered", {})
    unused = [n for n in config.streaming_settings() if n in layered]
    if not unused:
        return config
    names = ", ".join(layered[n] for n in unused)
    print(f"note: {names} not used: every source of {pipeline.name!r} is bounded", file=sys.stderr)
    return dataclasses.replace(config, **{n: getattr(RunConfig(), n) for n in unused})


def run_config(args: argparse.Namespace, **settings: Any) -> RunConfig:
    """The run's configuration from its generated flags (those the command has), and more.

    A switch's flag sets its field (``--no-progress`` clears ``progress``); a flag left unset
    (None) keeps the field's default. ``settings`` are fields the command derives itself.
    """
    values: dict[str, Any] = {}
    for f in flagged():
        if not hasattr(args, dest(f)):
            continue  # a command with only some of the flags (demo)
        value = getattr(args, dest(f))
        option = f.metadata["option"]
        if option.switch:
            value = bool(value) != option.invert
        if value is not None:
            values[f.name] = value
    return RunConfig.from_settings({**values, **settings}, "onceflow run", api_only=False)


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


def _start_ui(args: argparse.Namespace, config: RunConfig, pipeline: Any) -> Any:
    """The live page of a run (``--ui-port``), or None."""
    if config.ui_port is None:
        return None
    from onceflow.graph_optimizer.errors import GraphError
    from onceflow.operations.ui import pipeline_svg, serve

    try:
        svg = pipeline_svg(pipeline, _rules(args))
    except GraphError:  # no Graphviz: the page works without the drawing
        svg = ""
    server, url = serve(pipeline.name, config.redis_url, svg, port=config.ui_port)
    print(f"[{pipeline.name}] live page: {url}", file=sys.stderr, flush=True)
    return server


def kafka_waits(config: RunConfig) -> None:
    """``--kafka-start-wait``/``--kafka-outage-wait`` for the Kafka connectors to read.

    Connectors read their settings from the environment on the driver when the pipeline file
    builds them (their waits too: ``ONCEFLOW_KAFKA_START_WAIT``,
    ``ONCEFLOW_KAFKA_OUTAGE_WAIT``), so a flag is passed on there, checked first.
    """
    from onceflow.connectors.kafka.connection import KAFKA_OUTAGE_WAIT_ENV, KAFKA_START_WAIT_ENV
    from onceflow.kernel.durations import parse_duration_ms

    for value, flag, variable in (
        (config.kafka_start_wait, "--kafka-start-wait", KAFKA_START_WAIT_ENV),
        (config.kafka_outage_wait, "--kafka-outage-wait", KAFKA_OUTAGE_WAIT_ENV),
    ):
        if value:
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
    """Make the driver JVM's class-data archive (see onceflow.runtime.spark_env.jvm_archive)."""
    from onceflow.runtime.spark_env.jvm_archive import build

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
    result = pipeline.run(config=run_config(args, spark_conf=spark_conf(args)))
    top = sorted(sink.results, key=lambda kv: (-kv[1], kv[0]))[:15]
    print("Most frequent words:")
    for word, n in top:
        print(f"  {word:<14} {n:>4}")
    print()
    print(result.summary())
    return 0

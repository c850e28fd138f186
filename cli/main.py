"""The ``onceflow`` command: run, explain and demo pipelines (and operate them).

Every failure Onceflow anticipates ends with one ``error:`` line saying what to check and a
non-zero exit status: 2 for a wrong command line, file or setting, 1 for a failed run
(:func:`exit_status`).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from onceflow.cli.config import (
    CONFIG_ENV,
    check_config,
    check_environment,
    layered_defaults,
    read_config,
)
from onceflow.cli.dev import add_dev_command
from onceflow.cli.ops import add_commands
from onceflow.kernel.errors import ConfigError, OnceflowError
from onceflow.runtime.driver.run_config import (
    SPARK_GROUP,
    STREAMING_GROUP,
    RunConfig,
    closest,
    dest,
    flagged,
    value_type,
)

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
    from onceflow.kernel.durations import parse_duration_ms
    from onceflow.kernel.settings import KAFKA_OUTAGE_WAIT_ENV, KAFKA_START_WAIT_ENV

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


def add_config_options(p: argparse._ActionsContainer, group: str) -> None:
    """The flags of the :class:`RunConfig` fields of ``group``: name, type, help, default."""
    for f in flagged(group):
        option = f.metadata["option"]
        if option.switch:
            p.add_argument(option.flag, action="store_true", help=option.help)
            continue
        unit = " (seconds)" if option.unit == "s" and "second" not in option.help else ""
        kind = value_type(f)
        default = f.default.value if isinstance(f.default, enum.Enum) else f.default
        typed: dict[str, Any] = {} if option.choices or kind is str else {"type": kind}
        p.add_argument(
            option.flag,
            choices=option.choices,
            default=default,
            metavar=option.metavar,
            help=option.help + unit,
            **typed,
        )


def _add_spark_args(p: argparse.ArgumentParser) -> None:
    add_config_options(p, SPARK_GROUP)
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
    add_config_options(
        p.add_argument_group("streaming (pipelines with Kafka sources)"), STREAMING_GROUP
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
    add_dev_command(sub)
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
    args, extra = parser.parse_known_args(argv)
    commands = commands_of(parser)
    if extra:
        raise ConfigError(unknown_arguments(args.command, commands[args.command], extra))
    check_environment(environ, commands)
    path = getattr(args, "config", None) or environ.get(CONFIG_ENV) or None
    config: dict[str, Any] = {}
    if path:
        config = read_config(path)
        check_config(config, commands, path)
    origins: dict[str, str] = {}
    command = commands[args.command]
    defaults = layered_defaults(args.command, command, config, path, environ, origins)
    if not defaults:
        return args
    given = {d for d in defaults if getattr(args, d, None) != command.get_default(d)}
    command.set_defaults(**defaults)
    layered = parser.parse_args(argv)
    layered.layered = {d: where for d, where in origins.items() if d not in given}
    return layered


def unknown_arguments(command: str, parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """One line for arguments ``onceflow COMMAND`` does not know, with the closest option."""
    flags = [s for a in parser._actions for s in a.option_strings]  # noqa: SLF001
    unknown = [e.split("=", 1)[0] for e in extra if e.startswith("-")]
    if not unknown:
        return f"`onceflow {command}` got unexpected arguments {' '.join(extra)}"
    near = closest(unknown[0], [f for f in flags if f.startswith("--")])
    guess = f"; did you mean {near}?" if near else ""
    return f"`onceflow {command}` has no option {unknown[0]}{guess} (see onceflow {command} --help)"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``onceflow`` console script."""
    try:
        args = parse_args(argv)
        handler: Handler = args.handler
        return handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OnceflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_status(exc)


def exit_status(exc: OnceflowError) -> int:
    """2 for a wrong command line, pipeline file or setting; 1 for a run that failed.

    A service that does not answer (Kafka down at start), a sink that refuses its table, a
    task that failed: the run failed (1), whatever the command line said.
    """
    from onceflow.cli.errors import PipelineFileError
    from onceflow.graph_optimizer.errors import GraphError
    from onceflow.pipeline.errors import PipelineError

    usage = (ConfigError, PipelineFileError, PipelineError, GraphError)
    return 2 if isinstance(exc, usage) else 1


if __name__ == "__main__":
    raise SystemExit(main())

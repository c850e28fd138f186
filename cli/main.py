"""The ``onceflow`` command: run, explain and demo pipelines (and operate them).

Every failure Onceflow anticipates ends with one ``error:`` line saying what to check and a
non-zero exit status: 2 for a wrong command line, file or setting, 1 for a failed run
(:func:`exit_status`).
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from onceflow.cli.commands import cmd_demo, cmd_explain, cmd_jvm_cache, cmd_run, cmd_ui
from onceflow.cli.compact import add_compact_command
from onceflow.cli.config import (
    CONFIG_ENV,
    check_config,
    check_environment,
    layered_defaults,
    read_config,
)
from onceflow.cli.dev import add_dev_command
from onceflow.cli.ops import add_commands
from onceflow.cli.rescale import add_rescale_command
from onceflow.cli.savepoint import add_savepoint_command
from onceflow.cli.state import add_state_command
from onceflow.kernel.errors import ConfigError, OnceflowError
from onceflow.runtime.driver.run_config import (
    SPARK_GROUP,
    STREAMING_GROUP,
    closest,
    flagged,
    value_type,
)

Handler = Callable[[argparse.Namespace], int]


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
    add_compact_command(sub)
    add_state_command(sub)
    add_rescale_command(sub)
    add_savepoint_command(sub)
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

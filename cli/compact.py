"""``onceflow compact``: merge a pipeline's small Parquet files, while it runs or not.

From cron or by hand; see :mod:`onceflow.operations.compaction` for what is merged and why it
is safe.
"""

from __future__ import annotations

import argparse
from typing import Any

from onceflow.kernel.errors import ConfigError


def cmd_compact(args: argparse.Namespace) -> int:
    """Compact every Parquet sink of the pipeline (or the one named by ``--sink``)."""
    from onceflow.cli.loader import load_pipeline
    from onceflow.cli.ops import operator_redis
    from onceflow.operations.compaction import compact, parquet_sinks

    pipeline = load_pipeline(args.file, args.pipeline)
    namespace = args.namespace or pipeline.name
    sinks = parquet_sinks(pipeline)
    if args.sink:
        if args.sink not in sinks:
            have = ", ".join(sorted(sinks)) or "none"
            msg = f"pipeline {pipeline.name!r} has no Parquet sink {args.sink!r} (it has: {have})"
            raise ConfigError(msg)
        sinks = {args.sink: sinks[args.sink]}
    if not sinks:
        msg = f"pipeline {pipeline.name!r} has no Parquet sink: nothing to compact"
        raise ConfigError(msg)
    if args.target_mb <= 0:
        msg = f"--target-mb must be positive, got {args.target_mb}"
        raise ConfigError(msg)
    client = operator_redis(args, namespace)
    for name, sink in sinks.items():
        print(compact(client, namespace, name, sink, int(args.target_mb * (1 << 20))).text())
    return 0


def add_compact_command(sub: Any) -> None:
    """Register ``onceflow compact`` on the CLI's subparsers."""
    p = sub.add_parser(
        "compact",
        help="merge a pipeline's small Parquet files (safe while it runs)",
        description="Merge the small files of a pipeline's Parquet sinks, per folder, into "
        "files of up to --target-mb: only files of micro-batches Spark has committed (no retry "
        "can touch them), crash-safe (a compaction killed anywhere is finished by the next). "
        "Run it from cron as often as you like.",
    )
    p.add_argument("file", help="the pipeline file (as for onceflow run)")
    p.add_argument("--pipeline", help="which pipeline of the file (as for onceflow run)")
    p.add_argument("--sink", help="only this sink stage (default: every Parquet sink)")
    p.add_argument("--namespace", help="pipeline namespace (default: the pipeline's name)")
    p.add_argument("--redis-url", help="Redis (default $REDIS_URL)")
    p.add_argument(
        "--target-mb", type=float, default=128.0, help="largest merged file (default 128 MB)"
    )
    p.set_defaults(handler=cmd_compact)

"""``onceflow rescale``: change a stopped pipeline's parallelism and keep its state.

See :mod:`onceflow.runtime.driver.rescale` for what moves and what is refused. A run started
with another ``--parallelism`` does the same before its first micro-batch.
"""

from __future__ import annotations

import argparse
from typing import Any


def cmd_rescale(args: argparse.Namespace) -> int:
    """Move the namespace's keyed state, timers and seen-IDs to ``--parallelism`` partitions."""
    from onceflow.cli.ops import operator_redis, tag_clients
    from onceflow.kernel.errors import ConfigError
    from onceflow.runtime.driver.rescale import abort, rescale

    client = operator_redis(args, args.namespace)
    if args.abort:
        dropped = abort(client, args.namespace, connect=tag_clients(args))
        print("dropped the rescale cut short" if dropped else "no rescale under way")
        return 0
    if args.parallelism is None:
        msg = "onceflow rescale needs --parallelism N (or --abort)"
        raise ConfigError(msg)
    done = rescale(
        client,
        args.namespace,
        args.parallelism,
        connect=tag_clients(args),
        force=args.force,
        say=print,
    )
    if done.before == done.after:
        print(f"namespace {args.namespace!r} already has parallelism {done.after}")
        return 0
    print(
        f"moved {done.keys:,} keyed entries and timers; {done.seen_ids:,} seen-IDs copied into "
        f"each of the {done.after} partitions"
    )
    return 0


def add_rescale_command(sub: Any) -> None:
    """Register ``onceflow rescale`` on the CLI's subparsers."""
    p = sub.add_parser(
        "rescale",
        help="change a stopped pipeline's parallelism, keeping its state",
        description="Move a stopped pipeline's keyed state, timers and dedup history to "
        "another number of partitions per exchange. Safe to run again after an interruption "
        "(to the same parallelism or another). A run with another --parallelism does this "
        "itself before it starts.",
    )
    p.add_argument("--namespace", required=True, help="pipeline namespace (its name)")
    p.add_argument("--parallelism", type=int, help="the new parallelism")
    p.add_argument(
        "--abort",
        action="store_true",
        help="drop a rescale cut short while staging (nothing live had changed yet)",
    )
    p.add_argument("--redis-url", help="Redis (default $REDIS_URL)")
    p.add_argument(
        "--force",
        action="store_true",
        help="rescale although a driver's heartbeat says it runs (its machine was lost)",
    )
    p.set_defaults(handler=cmd_rescale)

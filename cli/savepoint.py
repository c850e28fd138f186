"""``onceflow savepoint create|restore``: a stopped pipeline's state to files, and back.

See :mod:`onceflow.operations.savepoint` for the format and what a restore guarantees.
"""

from __future__ import annotations

import argparse
from typing import Any


def cmd_savepoint(args: argparse.Namespace) -> int:
    """Write a savepoint of ``--namespace``, or restore one into it."""
    from onceflow.cli.ops import operator_redis, tag_clients
    from onceflow.operations import savepoint

    client = operator_redis(args, args.namespace)
    if args.action == "create":
        done = savepoint.create(
            client, args.namespace, args.to, args.checkpoint, connect=tag_clients(args)
        )
        print(
            f"savepoint of {args.namespace!r} in {done.folder}: {done.keys:,} keys "
            f"({done.records:,} records) and the checkpoint, in {done.seconds:.1f} s"
        )
        return 0
    done = savepoint.restore(
        client, args.source, args.namespace, args.checkpoint, connect=tag_clients(args)
    )
    print(
        f"restored {done.folder} into namespace {args.namespace!r} ({done.keys:,} keys) and "
        f"checkpoint {args.checkpoint} in {done.seconds:.1f} s: run the pipeline with "
        f"--namespace {args.namespace} --checkpoint {args.checkpoint}"
    )
    return 0


def add_savepoint_command(sub: Any) -> None:
    """Register ``onceflow savepoint`` on the CLI's subparsers."""
    p = sub.add_parser(
        "savepoint",
        help="write a stopped pipeline's state to a folder, or restore one",
        description="A savepoint holds a stopped pipeline's whole state (keyed state, timers, "
        "windows, dedup history) and its checkpoint (source positions) in a folder; restore "
        "it into the same namespace or another, on this Redis or another, and the pipeline "
        "continues from there, exactly once.",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="write a savepoint to a new folder")
    create.add_argument("--to", required=True, help="the savepoint's folder (must not exist)")
    restore = actions.add_parser("restore", help="restore a savepoint into an empty namespace")
    restore.add_argument("--from", dest="source", required=True, help="the savepoint's folder")
    for q, checkpoint in (
        (create, "the pipeline's --checkpoint (copied into the savepoint)"),
        (restore, "where the restored pipeline keeps its checkpoint (a new folder)"),
    ):
        q.add_argument("--namespace", required=True, help="pipeline namespace (its name)")
        q.add_argument("--checkpoint", required=True, help=checkpoint)
        q.add_argument("--redis-url", help="Redis (default $REDIS_URL)")
        q.set_defaults(handler=cmd_savepoint)

"""``onceflow state get|scan``: a stateful step's keyed state, read from Redis.

See :mod:`onceflow.operations.state_read` for what a read sees (committed chunks only).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from onceflow.kernel.errors import ConfigError


def cmd_state(args: argparse.Namespace) -> int:
    """Print the state of one key (``get``) or of every key, up to ``--limit`` (``scan``)."""
    from onceflow.cli.ops import operator_redis
    from onceflow.kernel.settings import RedisSettings, new_redis_client
    from onceflow.operations.state_read import read_state

    key: Any = None
    if args.action == "get":
        key = _key(args)
    elif args.limit is not None and args.limit < 1:
        msg = f"--limit must be at least 1, got {args.limit}"
        raise ConfigError(msg)
    client = operator_redis(args, args.namespace)
    settings = RedisSettings.from_env(args.redis_url)
    found = 0
    for entry in read_state(
        client,
        args.namespace,
        args.step,
        key=key,
        limit=None if args.action == "get" else args.limit,
        connect=lambda tag: new_redis_client(settings, tag),
    ):
        found += 1
        shown = entry.as_json()
        if args.json:
            print(json.dumps(shown, sort_keys=True))
        else:
            print(f"{shown['key']!r} (partition {entry.partition}): {json.dumps(shown['state'])}")
    if args.action == "get" and not found:
        print(f"no state for key {key!r} in step {args.step!r}")
        return 1
    return 0


def _key(args: argparse.Namespace) -> Any:
    if (args.key is None) == (args.key_json is None):
        msg = "onceflow state get needs one of --key TEXT or --key-json JSON"
        raise ConfigError(msg)
    if args.key is not None:
        return args.key
    from onceflow.operations.state_read import key_from_json

    try:
        return key_from_json(args.key_json)
    except (json.JSONDecodeError, ValueError) as exc:
        msg = f"--key-json is not a key in JSON: {exc}"
        raise ConfigError(msg) from None


def add_state_command(sub: Any) -> None:
    """Register ``onceflow state`` on the CLI's subparsers."""
    p = sub.add_parser(
        "state",
        help="read a stateful step's keyed state (one key, or a scan)",
        description="Read the keyed state of a pipeline's stateful step (a combine, a window, "
        "a process step, a join's table) from Redis, while the pipeline runs or not: every "
        "key as of its last committed chunk, never half-written.",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (("get", "the state of one key"), ("scan", "the state of every key")):
        q = actions.add_parser(action, help=text)
        q.add_argument("--namespace", required=True, help="pipeline namespace (its name)")
        q.add_argument("--step", required=True, help="the stateful step's name")
        q.add_argument("--redis-url", help="Redis (default $REDIS_URL)")
        q.add_argument("--json", action="store_true", help="one JSON object per key")
        if action == "get":
            q.add_argument("--key", help="the key, as text")
            q.add_argument(
                "--key-json",
                help='the key as JSON: an int 7, a tuple ["a", 1], bytes {"hex": "7531"}',
            )
        else:
            q.add_argument("--limit", type=int, help="at most this many keys")
        q.set_defaults(handler=cmd_state)

"""``onceflow dev up|down``: a local stack to develop against, in one command.

``up`` starts what a streaming pipeline needs on this machine, on loopback ports, with its data
in one folder (``--dev-dir``, default ``/var/tmp/onceflow-dev-<uid>``): Apache Kafka (one KRaft
node, the jars of :mod:`onceflow.testing.kafka`: replication factor 1 for every internal topic,
including the transaction log, and no time-based retention, so records of old event times
stay), and a Redis with AOF and ``appendfsync always`` (durable: what an exactly-once run
asks of it). ``--with postgres`` adds PostgreSQL (Debian's, password authentication) and
``--with registry`` a schema registry (Apicurio, in memory: schemas are lost at ``down``).

It prints the environment to export on standard output (``eval "$(onceflow dev up)"``) and
everything else on standard error, then returns: the services keep running in the
background. ``up`` again starts what is not running and prints the same environment (the
ports are kept in ``dev.json``); ``down`` stops the services and keeps their data, ``down
--wipe`` deletes it too.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from onceflow.kernel.errors import ConfigError, OnceflowError, ServiceError

STATE_FILE = "dev.json"
OPTIONAL = ("postgres", "registry")
STOP_WAIT_S = 30.0


def default_dir() -> str:
    """Where the stack keeps its data: a folder every service's user can reach."""
    return f"/var/tmp/onceflow-dev-{os.getuid()}"


def cmd_dev(args: argparse.Namespace) -> int:
    """``onceflow dev up`` or ``onceflow dev down``."""
    folder = Path(args.dev_dir or default_dir())
    if args.action == "down":
        return down(folder, args.wipe)
    wanted = _wanted(args.with_ or [])
    env = up(folder, wanted)
    for name, value in env.items():
        print(f"export {name}={shlex.quote(value)}")
    return 0


def _wanted(items: list[str]) -> list[str]:
    names = [n.strip() for item in items for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in OPTIONAL]
    if unknown:
        msg = f"onceflow dev up --with takes {', '.join(OPTIONAL)}, got {', '.join(unknown)}"
        raise ConfigError(msg)
    return ["kafka", "redis", *dict.fromkeys(names)]


def _say(text: str) -> None:
    print(f"[dev] {text}", file=sys.stderr, flush=True)


def _load(folder: Path) -> dict[str, Any]:
    path = folder / STATE_FILE
    if not path.exists():
        return {}
    state: dict[str, Any] = json.loads(path.read_text())
    return state


def _save(folder: Path, state: dict[str, Any]) -> None:
    tmp = folder / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
    tmp.replace(folder / STATE_FILE)


def alive(entry: dict[str, Any] | None) -> bool:
    """Whether a recorded service's process still runs (and is the one recorded)."""
    if not entry or not entry.get("pid"):
        return False
    try:
        cmdline = Path(f"/proc/{entry['pid']}/cmdline").read_bytes()
    except OSError:
        return False
    return str(entry["port"]).encode() in cmdline or entry["dir"].encode() in cmdline


def up(folder: Path, wanted: list[str]) -> dict[str, str]:
    """Start what is not running; the environment that reaches every service."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)  # PostgreSQL runs as its own user and must reach its folder
    state = _load(folder)
    for name in wanted:
        entry = state.get(name)
        if alive(entry):
            _say(f"{name} is running ({entry['pid']})")  # type: ignore[index]
            continue
        try:
            started = STARTERS[name](folder / name, (entry or {}).get("port"))
        except OnceflowError as exc:
            msg = f"{exc} (`onceflow dev down` stops what did start)"
            raise ServiceError(msg) from None
        state[name] = started
        _save(folder, state)
        _say(f"{name} started on port {started['port']} (data in {folder / name})")
    env: dict[str, str] = {}
    for name in wanted:
        env.update(state[name]["env"])
    return env


def down(folder: Path, wipe: bool) -> int:
    """Stop every service of the stack (SIGTERM, then SIGKILL); ``wipe``: delete the data."""
    state = _load(folder)
    for name, entry in state.items():
        if alive(entry):
            _stop(entry["pid"])
            _say(f"{name} stopped")
        entry["pid"] = None
    if state:
        _save(folder, state)
    if wipe and folder.exists():
        shutil.rmtree(folder)
        _say(f"deleted {folder}")
    elif not state:
        _say(f"nothing runs from {folder}")
    return 0


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or _zombie(pid):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _free(port: int | None) -> int | None:
    """``port`` when nothing listens on it (a service keeps its port across restarts)."""
    import socket

    if port is None:
        return None
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return None
    return port


def _kafka(folder: Path, port: int | None) -> dict[str, Any]:
    from onceflow.testing.kafka import LocalKafka
    from onceflow.testing.kafka_config import TEST_SETTINGS
    from onceflow.testing.services import untrack_process

    kafka = LocalKafka(str(folder), port=_free(port), properties=TEST_SETTINGS)
    kafka._fixed_ports = False  # noqa: SLF001 - a taken port may move on the first start
    kafka.start()
    untrack_process(kafka.proc)
    assert kafka.proc is not None
    env = {"KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap}
    return {"pid": kafka.proc.pid, "port": kafka.port, "dir": str(folder), "env": env}


def _redis(folder: Path, port: int | None) -> dict[str, Any]:
    from onceflow.testing.services import LocalRedis, untrack_process

    folder.mkdir(parents=True, exist_ok=True)
    redis = LocalRedis(str(folder), port=_free(port), appendfsync="always").start()
    untrack_process(redis.proc)
    assert redis.proc is not None
    env = {"REDIS_URL": redis.url}
    return {"pid": redis.proc.pid, "port": redis.port, "dir": str(folder), "env": env}


def _postgres(folder: Path, port: int | None) -> dict[str, Any]:
    from onceflow.testing.postgres import PASSWORD, LocalPostgres
    from onceflow.testing.services import free_port, untrack_process

    folder.mkdir(parents=True, exist_ok=True)
    pg = LocalPostgres(port=_free(port) or free_port(), folder=str(folder), keep=True).start()
    untrack_process(pg.proc)
    assert pg.proc is not None
    env = {"PG_CONNINFO": pg.conninfo, "PGPASSWORD": PASSWORD}
    return {"pid": pg.proc.pid, "port": pg.port, "dir": str(folder), "env": env}


def _registry(folder: Path, port: int | None) -> dict[str, Any]:
    from onceflow.testing.registry import LocalRegistry
    from onceflow.testing.services import untrack_process

    registry = LocalRegistry(port=_free(port)).start()
    untrack_process(registry.proc)
    assert registry.proc is not None
    env = {"SCHEMA_REGISTRY_URL": registry.url}
    return {"pid": registry.proc.pid, "port": registry.port, "dir": str(folder), "env": env}


STARTERS: dict[str, Callable[[Path, int | None], dict[str, Any]]] = {
    "kafka": _kafka,
    "redis": _redis,
    "postgres": _postgres,
    "registry": _registry,
}


def add_dev_command(sub: Any) -> None:
    """Register ``onceflow dev`` on the CLI's subparsers."""
    p = sub.add_parser(
        "dev",
        help="start or stop a local Kafka and Redis (and PostgreSQL, a schema registry)",
        description="up: start a local Kafka (KRaft) and a durable Redis, with --with "
        "postgres,registry also PostgreSQL and a schema registry, and print the environment "
        'to export (eval "$(onceflow dev up)"); down: stop them, keeping their data '
        "(--wipe deletes it).",
    )
    p.add_argument("action", choices=("up", "down"))
    p.add_argument(
        "--with",
        dest="with_",
        action="append",
        metavar="postgres,registry",
        help="also start these (repeatable or comma-separated)",
    )
    p.add_argument(
        "--dev-dir", help="where the services keep their data (default /var/tmp/onceflow-dev-UID)"
    )
    p.add_argument("--wipe", action="store_true", help="down: delete the data too")
    p.set_defaults(handler=cmd_dev)

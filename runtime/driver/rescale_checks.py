"""What a rescale checks before it writes anything, and the lock that keeps it alone.

See :mod:`onceflow.runtime.driver.rescale`. A rescale is refused, in one line and before any
write, when a task committed work of a micro-batch that is not acknowledged (its replay needs
the partitions it started with), when a sink partition has a delivery pending, when keyed
state lies outside partition scopes, when a scope holds a key the rescale does not know, and
when a hash tag lost its keys (a Redis Cluster master that came back empty: what it held
would be lost for good by a move). A driver of the namespace must be gone, and one rescale
runs at a time: it holds the namespace's ``rescale`` key (who, with a time-to-live, renewed
at every step), which a starting run also respects (:func:`refuse_while_rescaling`).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from onceflow.backup.store import acknowledged
from onceflow.dedup.durability import check_markers
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.keyspace import Keyspace, Kind
from onceflow.kernel.scopes import Connect, Scopes, read_scopes
from onceflow.kernel.script_args import delete_if_equal
from onceflow.kernel.store import store_for
from onceflow.runtime.driver.heartbeat import running_driver
from onceflow.runtime.driver.rescale_staging import HANDLED, KEYED, SCAN, STAGED

RESCALING_FIELD = "rescaling"  # meta: JSON of a rescale under way (phase, target, reach)
LOCK_TTL_MS = 300_000  # a rescale's lock lives this long past its last step


def underway(client: Any, home: Keyspace) -> dict[str, Any] | None:
    """The record of a rescale cut short (phase, target, reach), or None."""
    raw = store_for(client).hget(home.meta, RESCALING_FIELD)
    return json.loads(raw) if raw else None


def check(
    client: Any, home: Keyspace, parallelism: int, tag: Connect
) -> tuple[Scopes, dict[str, Any] | None]:
    """The namespace's scopes and a rescale under way; refuse what cannot be rescaled."""
    if parallelism < 1:
        msg = f"parallelism must be at least 1, got {parallelism}"
        raise ConfigError(msg)
    scopes = read_scopes(client, home)
    if scopes.parallelism < 1:
        msg = f"namespace {home.namespace!r} holds no pipeline (nothing to rescale)"
        raise ConfigError(msg)
    record = underway(client, home)
    if record is None and scopes.parallelism != parallelism:
        _refuse_unscoped_state(client, home)
        refuse_unfinished(client, home, tag, scopes, what="rescale", strict=True)
    return scopes, record


def refuse_unfinished(
    client: Any, home: Keyspace, tag: Connect, scopes: Scopes, *, what: str, strict: bool = False
) -> None:
    """Refuse a namespace a micro-batch is unfinished in, or whose Redis lost keys.

    ``what`` is done after (``rescale``, ``create the savepoint``); ``strict``: a key of a
    kind a rescale does not know is refused too.
    """
    acked = acknowledged(client, home)
    finish = (
        f"Run the pipeline once more with --parallelism {scopes.parallelism} "
        f"--stop-after-batches 1 (it finishes that micro-batch with the partitions it started "
        f"with), then {what}"
    )
    for ks in [home, *scopes.partition_keyspaces()]:
        _refuse_what_cannot_move(tag(ks.tag), ks, acked, finish, strict)
    targets = [(ks, tag(ks.tag)) for ks in scopes.keyspaces()]
    check_markers(targets, acked if acked >= 0 else None, home.namespace)


def _refuse_what_cannot_move(
    client: Any, ks: Keyspace, acked: int, finish: str, strict: bool
) -> None:
    """Work of an unacknowledged batch, a pending delivery, or a key of an unknown kind."""
    store = store_for(client)
    strict = strict and ks.scope is not None  # the namespace's own tag holds every kind
    for raw in store.scan_iter(ks.pattern(), SCAN):
        q = ks.parse(raw)
        if q is None:
            if strict and not raw.decode().startswith(f"{ks.root}:{STAGED}"):
                msg = f"a rescale does not know what to do with {raw!r}; this is an Onceflow bug"
                raise ConfigError(msg)
            continue
        if q.kind is Kind.BACKUP and q.batch is not None and q.batch > acked:
            msg = (
                f"namespace {ks.namespace!r} has micro-batch {q.batch} in flight: stage "
                f"{q.name!r} committed work of it that Spark did not commit. {finish}"
            )
            raise ConfigError(msg)
        if q.kind is Kind.PENDING and set(store.hgetall(raw.decode())) - {b"last"}:
            msg = (
                f"sink {q.name!r} of partition {q.partition} has a delivery pending: a "
                f"micro-batch did not finish. {finish}"
            )
            raise ConfigError(msg)
        if strict and q.kind not in HANDLED:
            msg = f"a rescale does not know what to do with {raw!r}; this is an Onceflow bug"
            raise ConfigError(msg)


def _refuse_unscoped_state(client: Any, home: Keyspace) -> None:
    """Keyed state kept per partition in the namespace's own tag cannot be moved by key."""
    for kind in sorted(KEYED, key=lambda k: k.value):
        for key in store_for(client).scan_iter(home.pattern(kind), SCAN):
            parsed = home.parse(key)
            name = parsed.name if parsed is not None else key
            msg = (
                f"namespace {home.namespace!r} keeps the state of {name!r} per partition "
                "outside a partition scope (a namespace made by an Onceflow before 0.9, or a "
                "stage keyed by its input partition): it cannot be moved by key. Keep "
                "its parallelism, or start a new namespace"
            )
            raise ConfigError(msg)


def wait_for_driver(  # noqa: PLR0913 - what waits, and how long
    client: Any,
    home: Keyspace,
    wait_s: float,
    force: bool,
    tell: Callable[[str], None],
    what: str = "rescale",
) -> None:
    """Return once no driver of the namespace runs; raise if one still does after ``wait_s``.

    A driver killed -9 leaves its heartbeat to expire (30 s); one on this host whose process
    is gone is known dead at once. Its tasks, wherever they still run, are fenced by the epoch
    the rescale takes before it moves anything.
    """
    deadline = time.monotonic() + wait_s
    told = False
    while (driver := running_driver(client, home)) is not None and not force:
        if dead_here(driver):
            return
        if time.monotonic() >= deadline:
            force_it = ", or give onceflow rescale --force" if what == "rescale" else ""
            msg = (
                f"a driver of namespace {home.namespace!r} is running ({_who(driver)}): stop "
                f"it before a {what}. If it is gone for good (its machine was lost), its "
                f"heartbeat expires within 30 s{force_it}"
            )
            raise ConfigError(msg)
        if not told:
            tell(f"waiting for the last driver's heartbeat to expire ({driver.get('host')})")
            told = True
        time.sleep(1.0)


def dead_here(holder: dict[str, Any]) -> bool:
    """Whether a driver or a rescale ran on this host and its process is gone."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _who(holder: dict[str, Any]) -> str:
    return f"process {holder.get('pid', '?')} on {holder.get('host', '?')}"


def take_lock(client: Any, home: Keyspace, force: bool) -> str:
    """Hold the namespace's rescale lock (see the module docstring); its token."""
    token = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "at": time.time()})
    store = store_for(client)
    if store.set_nx(home.rescale, token, LOCK_TTL_MS):
        return token
    holder = _holder(store.get(home.rescale))
    if not force and holder is not None and not dead_here(holder):
        msg = (
            f"a rescale of namespace {home.namespace!r} is under way ({_who(holder)}): let it "
            "finish. If it is gone for good, its lock expires within 5 minutes of its last "
            "step, or give onceflow rescale --force"
        )
        raise ConfigError(msg)
    store.set(home.rescale, token, px=LOCK_TTL_MS)
    return token


def renew_lock(client: Any, home: Keyspace, token: str) -> None:
    """Keep the lock another :data:`LOCK_TTL_MS` (after each step)."""
    store_for(client).set(home.rescale, token, px=LOCK_TTL_MS)


def release_lock(client: Any, home: Keyspace, token: str) -> None:
    """Let go of the lock, if it is still this rescale's."""
    keys, args = delete_if_equal(home.rescale, token)
    store_for(client).script("delete_if_equal", keys, args)


def _holder(raw: bytes | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        found = json.loads(raw)
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def refuse_while_rescaling(client: Any, home: Keyspace) -> None:
    """A starting run, after it took its epoch: no rescale may be moving the state under it.

    A rescale that took its lock before this run's epoch was taken raised its own epoch after,
    fencing this run's tasks; one whose lock is held now is refused here. Either way the two
    never write at once.
    """
    holder = _holder(store_for(client).get(home.rescale))
    if holder is not None and not dead_here(holder):
        msg = (
            f"a rescale of namespace {home.namespace!r} is under way ({_who(holder)}): start "
            "the pipeline once it has finished"
        )
        raise ConfigError(msg)
    if underway(client, home) is not None:
        msg = (
            f"a rescale of namespace {home.namespace!r} was cut short: finish it with onceflow "
            f"rescale --namespace {home.namespace} --parallelism N, or run with --rescale"
        )
        raise ConfigError(msg)

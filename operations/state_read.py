"""Reading a pipeline's keyed state from outside the run: ``onceflow state get|scan``.

A stateful step (a combine, a window's combine, a ``process`` step, a join's table) keeps one
Redis hash per partition: encoded key -> encoded state. Each micro-batch's chunk commits its
state changes together with the IDs it has seen, in one atomic Redis call, and a committed
chunk is never undone (a replay finds its IDs seen and skips them). So a read sees, for every
key, the state after some committed chunk: never a half-written one. It may already include
chunks of the micro-batch under way, which are as final as the ones before.

Keys and states are MessagePack (never pickle). A ``process`` step's state is shown as
``{"state": {spec: value}, "timers": [[tag, domain, time, hold], ...], "expires": ms or
None}``; a combine's is its accumulator (a sum's number, a mean's ``[sum, count]``, a window's
panes). A value holding a record class the reader cannot import is shown as its bytes in hex
with the reason.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from onceflow.kernel import codec
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.scopes import PLAN_FIELD, Connect, node_keyspaces, tag_client

SCAN_COUNT = 1000
_COMBINE = re.compile(r"^\((?P<phase>\w+)\) ")  # after the name: "(full) Sum", "(final) Mean"


@dataclass(frozen=True)
class StateEntry:
    """One key's state in one partition."""

    key: Any
    state: Any
    partition: int

    def as_json(self) -> dict[str, Any]:
        """JSON-ready (bytes as hex, tuples as lists)."""
        return {"key": _plain(self.key), "state": _plain(self.state), "partition": self.partition}


def stateful_steps(client: Any, namespace: str) -> dict[str, str]:
    """The namespace's stateful steps (by the stored plan): name -> "combine" or "process"."""
    raw = client.hget(Keyspace(namespace).meta, PLAN_FIELD)
    if raw is None:
        msg = (
            f"namespace {namespace!r} has no stored plan in this Redis: check the namespace "
            "(default: the pipeline's name) and REDIS_URL"
        )
        raise ConfigError(msg)
    layout = json.loads(raw)
    # a step's name may hold spaces: each entry is matched against the plan's node names
    nodes = sorted({n for members in layout.get("stages", {}).values() for n in members}, key=len)
    steps: dict[str, str] = {}
    for text in layout.get("state", []):
        name = next((n for n in reversed(nodes) if text.startswith(n + " ")), None)
        if name is None:
            continue
        rest = text[len(name) + 1 :]
        steps[name] = "combine" if _COMBINE.match(rest) else "process"
    return steps


def key_from_json(text: str) -> Any:
    """A key given as JSON.

    An int (``7``), text (``"u1"``), a tuple (``["a", 1]``, nested lists as tuples too), or
    bytes (``{"hex": "7531"}``).
    """
    return _as_key(json.loads(text))


def _as_key(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_as_key(v) for v in value)
    if isinstance(value, dict) and set(value) == {"hex"}:
        return bytes.fromhex(value["hex"])
    return value


def read_state(
    client: Any,
    namespace: str,
    step: str,
    *,
    key: Any = None,
    limit: int | None = None,
    connect: Connect | None = None,
) -> Iterator[StateEntry]:
    """The state of ``step``: of one ``key`` if given (else every key, ``limit`` at most)."""
    kind = _kind(client, namespace, step)
    shown = 0
    for partition, ks in enumerate(node_keyspaces(client, namespace, step)):
        tag = tag_client(client, ks, connect)
        field_name = ks.state(step, partition)
        if key is not None:
            raw = tag.hget(field_name, codec.encode(key))
            if raw is not None:
                yield StateEntry(key, _state(raw, kind), partition)
                return
            continue
        seen: set[bytes] = set()  # HSCAN may return a key twice (the hash grew meanwhile)
        for raw_key, raw in tag.hscan_iter(field_name, count=SCAN_COUNT):
            if raw_key in seen:
                continue
            if limit is not None and shown >= limit:
                return
            seen.add(raw_key)
            shown += 1
            yield StateEntry(_decoded(raw_key), _state(raw, kind), partition)


def _kind(client: Any, namespace: str, step: str) -> str:
    steps = stateful_steps(client, namespace)
    if step not in steps:
        have = ", ".join(sorted(steps)) or "none"
        msg = f"namespace {namespace!r} has no stateful step {step!r} (stateful steps: {have})"
        raise ConfigError(msg)
    return steps[step]


def _state(raw: bytes, kind: str) -> Any:
    value = _decoded(raw)
    if kind == "process" and isinstance(value, list) and len(value) == 3:
        cells, timers, expires = value
        return {"state": cells, "timers": timers, "expires": expires}
    return value


def _decoded(raw: bytes) -> Any:
    try:
        return codec.decode(raw)
    except Exception as exc:  # noqa: BLE001 - shown, not fatal: one undecodable value
        return {"undecodable": raw.hex(), "reason": str(exc)}


def _plain(value: Any) -> Any:
    """A decoded value as JSON can hold it."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {str(_plain(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN or infinity: "nan", "inf"
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    fields = getattr(value, "__dict__", None)
    return _plain(fields) if isinstance(fields, dict) else repr(value)

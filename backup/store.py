"""Writing, replaying and acknowledging backups in Redis.

A chunk's outputs are written by the commit script (:data:`~onceflow.kernel.scripts.COMMIT`)
in the same atomic step that marks its inputs seen; :func:`chunk_args` prepares the two
arguments that step takes, and :func:`inputs_args` the two for the chunk's input IDs. The
end-of-task outputs and the ``done`` marker are written by
:func:`finish`, with the state changes that go with them. :func:`replay` reads what earlier
attempts committed. Backups of micro-batches Spark has committed are acknowledged
(:func:`acknowledge`) and then are garbage (:func:`is_garbage`, used by ``onceflow gc`` and
``onceflow status``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from onceflow.backup.format import TaskBackup, chunk_field, encode_outputs, inputs_field
from onceflow.kernel.keyspace import Keyspace, Kind, ParsedKey
from onceflow.kernel.records import Output
from onceflow.kernel.script_args import Fence, ack, finish_args
from onceflow.kernel.store import store_for

if TYPE_CHECKING:
    from onceflow.kernel.store import Connection


def chunk_args(chunk: int, outputs: list[Output]) -> tuple[str, bytes]:
    """The backup hash field and the blob of one chunk's outputs, for the commit script."""
    return chunk_field(chunk), encode_outputs(outputs)


def inputs_args(chunk: int, rids: list[bytes]) -> tuple[str, bytes]:
    """The backup hash field and the blob of the input IDs one chunk commits."""
    return inputs_field(chunk), b"".join(rids)


def replay(fields: dict[bytes, bytes]) -> TaskBackup:
    """What the fields of a task's backup hash (``HGETALL``) say earlier attempts did."""
    return TaskBackup.parse(fields)


def finish(
    client: Connection,
    fence: Fence,
    keys: list[str],
    outputs: list[Output],
    state: list[Any],
    stats: Mapping[str, int],
) -> Any:
    """Store a task's end-of-task outputs and mark it done, fenced like a commit.

    ``keys`` are the call's KEYS: the fence's, the backup hash, the stats hash and then the
    keys ``state`` (the state and timer arguments that go with the outputs: panes fired,
    windows closed) refers to; ``stats`` the counter increments. Returns the script's reply
    (the caller checks it for fencing).
    """
    blob = encode_outputs(outputs) if outputs else b""
    return store_for(client).script("finish", keys, finish_args(fence, blob, state, stats))


def acknowledge(client: Connection, keyspace: Keyspace, batch: int) -> None:
    """Record that Spark committed every micro-batch up to ``batch`` (never moves back).

    Backups of acknowledged batches are garbage; GC measures its floor from the acknowledged
    batch's parameters (:mod:`onceflow.dedup.batch`), never from a batch that may replay.
    """
    keys, args = ack(keyspace, batch)
    store_for(client).script("ack", keys, args)


def acknowledged(client: Connection, keyspace: Keyspace) -> int:
    """The last acknowledged micro-batch, -1 when none."""
    raw = store_for(client).get(keyspace.acked)
    return int(raw) if raw is not None else -1


def is_garbage(parsed: ParsedKey | None, acked: int) -> bool | None:
    """For a backup key: True once its micro-batch is acknowledged; None for other keys."""
    if parsed is None or parsed.kind is not Kind.BACKUP or parsed.batch is None:
        return None
    return parsed.batch <= acked

"""The backup format, its replay, and acknowledgement.

A task's backup is a Redis hash ``bk:<stage>:<batch>:<partition>``: field ``c<n>`` holds the
encoded outputs of chunk ``n``, ``final`` those produced at the end of the task (combine
results), and ``done`` marks a finished task. Outputs are MessagePack lists, never pickles.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from onceflow.errors import CodecError
from onceflow.keyspace import Keyspace
from onceflow.records import Output

DONE = "done"
FINAL = "final"


def chunk_field(chunk: int) -> str:
    """Hash field of chunk ``chunk``."""
    return f"c{chunk}"


def encode_outputs(outputs: list[Output]) -> bytes:
    """Outputs as one MessagePack blob."""
    return msgpack.packb(outputs, use_bin_type=True)  # type: ignore[no-any-return]


def decode_outputs(blob: bytes) -> list[Output]:
    """Outputs back from :func:`encode_outputs`."""
    try:
        rows = msgpack.unpackb(blob, raw=False, use_list=True)
        return [Output(int(t), bytes(i), int(ts), k, bytes(v)) for t, i, ts, k, v in rows]
    except Exception as exc:
        msg = f"a backup blob of {len(blob)} bytes is corrupt: {exc}"
        raise CodecError(msg) from exc


@dataclass
class TaskBackup:
    """What a task's backup hash says."""

    outputs: list[Output] = field(default_factory=list)
    done: bool = False
    next_chunk: int = 0

    @classmethod
    def parse(cls, fields: Mapping[bytes, bytes]) -> TaskBackup:
        """Order chunks by number, then the final outputs."""
        chunks: list[tuple[int, bytes]] = []
        final = None
        done = False
        for raw_name, blob in fields.items():
            name = raw_name.decode()
            if name == DONE:
                done = True
            elif name == FINAL:
                final = blob
            elif name.startswith("c"):
                chunks.append((int(name[1:]), blob))
        chunks.sort()
        outputs: list[Output] = []
        for _, blob in chunks:
            outputs.extend(decode_outputs(blob))
        if final is not None:
            outputs.extend(decode_outputs(final))
        next_chunk = chunks[-1][0] + 1 if chunks else 0
        return cls(outputs, done, next_chunk)


def parse_backup_key(keyspace: Keyspace, key: str) -> tuple[str, int, int] | None:
    """``(stage, batch, partition)`` of a backup key of this namespace, else None."""
    prefix = f"{keyspace.root}:bk:"
    if not key.startswith(prefix):
        return None
    stage, batch, partition = key[len(prefix) :].rsplit(":", 2)
    try:
        return stage, int(batch), int(partition)
    except ValueError:
        return None


# KEYS: 1 acked, 2 watermark, 3 acked watermark. ARGV: 1 batch
_ACK = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '-1')
if tonumber(ARGV[1]) > cur then
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('SET', KEYS[3], redis.call('GET', KEYS[2]) or '0')
  return 1
end
return 0
"""


def acknowledge(client: Any, keyspace: Keyspace, batch: int) -> None:
    """Record that Spark committed every micro-batch up to ``batch`` (never moves back).

    Called before the next batch starts, so the watermark then is that of committed batches:
    it is kept as the acknowledged watermark the dedup floor and GC are measured from.
    """
    client.eval(_ACK, 3, keyspace.acked, keyspace.watermark, keyspace.acked_watermark, batch)


def acknowledged(client: Any, keyspace: Keyspace) -> int:
    """The last acknowledged micro-batch, -1 when none."""
    raw = client.get(keyspace.acked)
    return int(raw) if raw is not None else -1

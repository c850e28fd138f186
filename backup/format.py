"""The backup format.

A task's backup is a Redis hash ``bk:<stage>:<batch>:<partition>``: field ``c<n>`` holds the
encoded outputs of chunk ``n``, ``final`` those produced at the end of the task (combine
results; past one chunk's bytes the task commits the first of them as chunks of their own),
and ``done`` marks a finished task. Outputs are MessagePack lists, never pickles.
Targets below zero are a stage's partial-combine deltas: backed up, never sent.

Field ``i<n>`` holds the input IDs chunk ``n`` committed (16 bytes each, concatenated),
written in the same atomic step as ``c<n>``: a later attempt of the task treats those inputs
as replayed, since the seen-IDs do not say which task committed them (see the seen-ID layout
in :mod:`onceflow.kernel.keyspace`).

Field ``dl:<k>:<sink>`` holds the IDs of the task's ``k``-th delivery to sink
``<sink>`` that became visible (``dl#`` counts them): a later attempt of the task, the only
one that can deliver those records again, skips them (see :mod:`onceflow.dedup.delivery`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import msgpack

from onceflow.kernel.errors import CodecError
from onceflow.kernel.ids import split_ids
from onceflow.kernel.records import Output

DONE = "done"
FINAL = "final"
CHUNK_PREFIX = "c"
INPUTS_PREFIX = "i"
DELIVERED_PREFIX = "dl:"  # + "<k>:<sink>": IDs of a delivery that became visible
DELIVERIES = "dl#"  # how many deliveries the task logged (numbers their fields)


def chunk_field(chunk: int) -> str:
    """Hash field of chunk ``chunk``."""
    return f"{CHUNK_PREFIX}{chunk}"


def inputs_field(chunk: int) -> str:
    """Hash field of the input IDs chunk ``chunk`` committed."""
    return f"{INPUTS_PREFIX}{chunk}"


def delivered_field_parts(sink: str) -> tuple[str, str]:
    """What comes before and after ``<k>`` in the field of a delivery to ``sink``."""
    return DELIVERED_PREFIX, f":{sink}"


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
    """What a task's backup hash says: what earlier attempts of the task committed.

    ``outputs`` are replayed (never recomputed), ``done`` says the task finished,
    ``next_chunk`` is the number of the first chunk no attempt committed, ``inputs`` the
    IDs of the inputs earlier attempts committed, ``delivered`` the IDs earlier attempts
    delivered, per sink, and ``deliveries`` how many deliveries they logged, per sink.
    """

    outputs: list[Output] = field(default_factory=list)
    done: bool = False
    next_chunk: int = 0
    inputs: frozenset[bytes] = frozenset()
    delivered: dict[str, set[bytes]] = field(default_factory=dict)
    deliveries: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, fields: Mapping[bytes, bytes]) -> TaskBackup:
        """Order chunks by number, then the final outputs."""
        chunks: list[tuple[int, bytes]] = []
        final = None
        done = False
        inputs: set[bytes] = set()
        delivered: dict[str, set[bytes]] = {}
        deliveries: dict[str, int] = {}
        for raw_name, blob in fields.items():
            name = raw_name.decode()
            if name.startswith(DELIVERED_PREFIX):
                sink = name[len(DELIVERED_PREFIX) :].split(":", 1)[1]
                delivered.setdefault(sink, set()).update(split_ids(blob, "a delivery's IDs"))
                deliveries[sink] = deliveries.get(sink, 0) + 1
            elif name == DELIVERIES:
                continue
            elif name == DONE:
                done = True
            elif name == FINAL:
                final = blob
            elif name.startswith(CHUNK_PREFIX):
                chunks.append((int(name[1:]), blob))
            elif name.startswith(INPUTS_PREFIX):
                inputs.update(split_ids(blob, "a backup's input IDs"))
        chunks.sort()
        outputs: list[Output] = []
        for _, blob in chunks:
            outputs.extend(decode_outputs(blob))
        if final is not None:
            outputs.extend(decode_outputs(final))
        next_chunk = chunks[-1][0] + 1 if chunks else 0
        return cls(outputs, done, next_chunk, frozenset(inputs), delivered, deliveries)

"""Every Lua script Onceflow runs in Redis: the registry of the commit protocol.

The scripts are package files, ``kernel/lua/<name>.lua`` (a name starting with ``_`` is a
piece several scripts share: a Lua function, or the fence checks); each file's opening
comment says what its KEYS and ARGV are. Nothing else in Onceflow holds Lua. Key names come
from :mod:`onceflow.kernel.keyspace`. :data:`SCRIPTS` says which pieces each script is made
of; they are read once per process, and registered once per client (:func:`scripts_for`:
EVALSHA, loaded again after a Redis restart).

Every script that writes first checks three fences (``_fence.lua``): the Redis server the
batch started on (its run id: a restarted server, or the replica a failover promoted, may
have lost writes, and nothing may be written on top of what is left, see
:mod:`onceflow.dedup.durability`), the driver epoch (bumped when a driver starts) and the task
token (the attempt that claimed the stage partition, see ``claim.lua``). A zombie driver or
task attempt therefore cannot commit after its successor has started, and a zombie that
starts late cannot take the partition from a newer attempt.

``commit.lua`` is the heart of exactly-once: in one atomic step it checks that none of the
chunk's IDs was seen before in the batch's generation, marks them seen, stores the chunk's
outputs (the upstream backup for the next boundary) and its input IDs (how a later attempt
of the task knows what it committed), writes keyed state, appends the IDs to the receiver's
Bloom journal, raises the source lanes' event-time marks and bumps counters. If any ID was
already seen it undoes its marks before returning (the script is atomic, so nobody sees
them), returns the positions of those IDs in the chunk, and the task redoes the chunk
without them. One ``HSETNX`` per ID does the check and the mark together. It is idempotent:
run twice (a retried call after a lost reply), the second run sees its chunk already stored
and changes nothing.

Seen-IDs are fields of sharded hashes, in the seen-ID layout (see
:mod:`onceflow.kernel.keyspace`): the scripts take them as Python built them, one blob of
``n`` fields of one width (what the shard does not say of each ID), and the value to store.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from typing import Any

from onceflow.kernel.keyspace import GC_FLOOR_FIELD

# Each script: the shared pieces it starts with, in order, then its own file.
SCRIPTS: dict[str, tuple[str, ...]] = {
    "claim": ("_parse_token", "_server"),
    "commit": ("_server", "_fence", "_raise_generation", "_write_state", "_seen_fields"),
    "finish": ("_server", "_fence", "_write_state"),
    "prepare_delivery": ("_server", "_fence"),
    "log_delivery": ("_server", "_fence"),
    "note_writer": ("_server", "_fence"),
    "lookup": ("_seen_fields",),
    "catch_up": (),
    "snapshot": ("_server", "_fence"),
    "batch_params": ("_server",),
    "ack": (),
    "forget_generation": (),
    "raise_epoch": (),
    "raise_generations": ("_server",),
    "raise_lanes": (),
    "expire_state": (),
    "delete_if_equal": (),
}
# Values the scripts take from Python constants: @NAME@ in a file.
_CONSTANTS = {"@GC_FLOOR@": GC_FLOOR_FIELD}


def _file(name: str) -> str:
    return files("onceflow.kernel").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


@cache
def source(name: str) -> str:
    """The Lua of script ``name`` (a key of :data:`SCRIPTS`), as Redis runs it."""
    text = "".join(_file(part) for part in (*SCRIPTS[name], name))
    for placeholder, value in _CONSTANTS.items():
        text = text.replace(placeholder, value)
    return text


CLAIM = source("claim")
COMMIT = source("commit")
FINISH = source("finish")
PREPARE_DELIVERY = source("prepare_delivery")
LOG_DELIVERY = source("log_delivery")
NOTE_WRITER = source("note_writer")
LOOKUP = source("lookup")
CATCH_UP = source("catch_up")
SNAPSHOT = source("snapshot")
BATCH_PARAMS = source("batch_params")
ACK = source("ack")
FORGET_GENERATION = source("forget_generation")
RAISE_EPOCH = source("raise_epoch")
RAISE_GENERATIONS = source("raise_generations")
RAISE_LANES = source("raise_lanes")
EXPIRE_STATE = source("expire_state")
DELETE_IF_EQUAL = source("delete_if_equal")


class Scripts:
    """The scripts registered on one client (EVALSHA, reloaded after a Redis restart)."""

    def __init__(self, client: Any) -> None:
        register = client.register_script
        self.claim = register(CLAIM)
        self.commit = register(COMMIT)
        self.finish = register(FINISH)
        self.prepare_delivery = register(PREPARE_DELIVERY)
        self.log_delivery = register(LOG_DELIVERY)
        self.note_writer = register(NOTE_WRITER)
        self.lookup = register(LOOKUP)
        self.snapshot = register(SNAPSHOT)
        self.catch_up = register(CATCH_UP)
        self.batch_params = register(BATCH_PARAMS)
        self.ack = register(ACK)
        self.forget_generation = register(FORGET_GENERATION)
        self.raise_lanes = register(RAISE_LANES)
        self.raise_generations = register(RAISE_GENERATIONS)
        self.raise_epoch = register(RAISE_EPOCH)
        self.expire_state = register(EXPIRE_STATE)
        self.delete_if_equal = register(DELETE_IF_EQUAL)


_REGISTERED: dict[int, Scripts] = {}


def scripts_for(client: object) -> Scripts:
    """The registry bound to ``client`` (one per client and process)."""
    found = _REGISTERED.get(id(client))
    if found is None:
        found = Scripts(client)
        _REGISTERED[id(client)] = found
    return found

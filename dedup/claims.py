"""Layout 4's claims: a chunk's source IDs claimed per ID tag before its commit.

Designed in docs/concepts/dedup.md ("Spreading a source stage's seen-IDs over a Redis
Cluster"); used by namespaces made with layout 4 (``onceflow run --spread-seen``; every other
namespace keeps layout 3). A chunk's IDs are
split by the ID tag of their seen shard (:func:`onceflow.kernel.id_tags.tag_of_shard`); one
call of ``kernel/lua/claim_ids.lua`` per tag checks each ID in every live generation of the
tag and claims the new ones in the batch's generation, the claim's value the record's origin
(:func:`onceflow.kernel.id_tags.origin`) and content fingerprint. :func:`settle` then sorts
what the calls found: an ID held with the record's own origin was claimed by an earlier
attempt of the same batch and is this record's; another origin makes the record a copy (or,
with another fingerprint, an ID conflict) that the chunk drops before its commit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from onceflow.backup.store import replay
from onceflow.dedup.addressing import RUN, KeyTable, seen_fields, shards_of
from onceflow.dedup.errors import ServerChangedError, server_changed_message
from onceflow.dedup.session import FENCED
from onceflow.kernel.errors import OnceflowError
from onceflow.kernel.id_tags import ORIGIN_BYTES, id_tag
from onceflow.kernel.ids import ID_BYTES
from onceflow.kernel.keyspace import (
    PRINT_BYTES,
    SCAN_ALL,
    SEEN_MARK,
    Keyspace,
    glob_escape,
    same_content,
    seen_field,
    shard_of,
)
from onceflow.kernel.store import Store, store_for

CLAIM_BYTES = ORIGIN_BYTES + PRINT_BYTES  # a claim's value: origin, then fingerprint


@dataclass(frozen=True)
class ClaimCall:
    """One claim call on one ID tag: its KEYS, ARGV, and which of the chunk's IDs it sends."""

    tag: int
    keys: list[str]
    args: list[bytes | int | str]
    members: np.ndarray  # positions (0-based) in the chunk of the fields sent, in their order


def claim_calls(
    namespace: str,
    tags: int,
    shards: int,
    receiver: str,
    generations: Sequence[int],
    rids: Sequence[bytes],
    values: Sequence[bytes],
    server: dict[int, str],
    newest: int,
) -> list[ClaimCall]:
    """The calls that claim ``rids`` (values: origin + fingerprint each), one per ID tag.

    ``generations``: the live ones, the batch's first (IDs are claimed there). ``server``:
    each tag's master's run id noted when the batch started (a missing tag checks nothing).
    """
    if not rids:
        return []
    raw = np.frombuffer(b"".join(rids), dtype=np.uint8).reshape(-1, ID_BYTES)
    of = shards_of(raw, shards)
    tag_of = of % tags  # kernel.id_tags.tag_of_shard
    order = np.lexsort((of, tag_of))  # by tag, then shard
    blob = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(rids), -1)
    calls = []
    for tag in np.unique(tag_of):
        members = order[tag_of[order] == tag]
        ks = id_tag(namespace, int(tag), tags)
        keys = KeyTable([ks.generations])
        unique, counts = np.unique(of[members], return_counts=True)
        runs = np.zeros(len(unique), dtype=RUN)
        for r, shard in enumerate(unique):
            first = [keys.add(ks.seen(receiver, g, int(shard))) for g in generations][0]
            runs[r] = (first, counts[r])
        args: list[bytes | int | str] = [
            server.get(int(tag), ""),
            generations[0],
            newest,
            len(generations),
            len(members),
            seen_fields(raw[members], shards),
            runs.tobytes(),
            blob[members].tobytes(),
        ]
        calls.append(ClaimCall(int(tag), keys.keys, args, members))
    return calls


@dataclass(frozen=True)
class Settled:
    """What a chunk's claims decided, by position in the chunk (0-based)."""

    copies: set[int]  # held by another record with the same content: dropped
    conflicts: set[int]  # held by another record with other content: dropped, counted apart


def settle(
    calls: Sequence[ClaimCall], replies: Sequence[list[object]], values: Sequence[bytes]
) -> Settled:
    """Sort the held IDs of each call's ``{'ok', positions, held}`` reply by their holders.

    An ID held with the record's own origin is the record's (an earlier attempt claimed it);
    one held with another origin is a copy, or an ID conflict when the fingerprints differ.
    """
    copies: set[int] = set()
    conflicts: set[int] = set()
    for call, reply in zip(calls, replies, strict=True):
        positions, held = reply[1], reply[2]
        if reply[0] != b"ok" or not isinstance(positions, list) or not isinstance(held, list):
            msg = f"a claim on ID tag {call.tag} was refused: {reply[:2]!r}"
            raise OnceflowError(msg)
        for p, value in zip(positions, held, strict=True):
            j = int(call.members[int(p) - 1])
            own = values[j]
            if value[:ORIGIN_BYTES] == own[:ORIGIN_BYTES]:
                continue
            same = same_content(value[ORIGIN_BYTES:], int.from_bytes(own[ORIGIN_BYTES:], "big"))
            (copies if same else conflicts).add(j)
    return Settled(copies, conflicts)


@dataclass
class Claimer:
    """Claims a source stage's IDs on its namespace's ID tags for one task (layout 4).

    ``connect`` gives the client of a hash tag; ``servers`` each tag's master's run id when
    the batch started. Calls on tags served by one client go in one pipeline.
    """

    namespace: str
    tags: int
    shards: int
    receiver: str
    batch: int
    connect: Callable[[str], Any]
    servers: Mapping[str, str]

    def claim(
        self, rids: Sequence[bytes], values: Sequence[bytes], live: Sequence[int], newest: int
    ) -> Settled:
        """Claim ``rids`` in ``live[0]`` (looking in every ``live`` generation); settle them."""
        by_tag = {
            k: self.servers.get(id_tag(self.namespace, k, self.tags).tag, "")
            for k in range(self.tags)
        }
        calls = claim_calls(
            self.namespace,
            self.tags,
            self.shards,
            self.receiver,
            live,
            rids,
            values,
            by_tag,
            newest,
        )
        replies: list[list[object]] = [[] for _ in calls]
        groups: dict[int, tuple[Any, list[int]]] = {}
        for n, call in enumerate(calls):
            client = self.connect(id_tag(self.namespace, call.tag, self.tags).tag)
            groups.setdefault(id(client), (client, []))[1].append(n)
        for client, members in groups.values():
            cmds = store_for(client).batch()
            for n in members:
                cmds.script("claim_ids", calls[n].keys, calls[n].args)
            for n, reply in zip(members, cmds.execute(), strict=True):
                replies[n] = reply
        for call, reply in zip(calls, replies, strict=True):
            if reply and reply[0] == FENCED:
                where = f"ID tag {id_tag(self.namespace, call.tag, self.tags).tag}"
                raise ServerChangedError(server_changed_message(where, self.batch))
        return settle(calls, replies, values)


def remark(
    client: Any,
    namespace: str,
    tags: int,
    shards: int,
    stages: Sequence[str],
    batch: int,
    generation: int,
    connect: Callable[[str], Any],
) -> int:
    """Claim again, on their ID tags, the inputs a batch's committed chunks hold; return how many.

    Run by the driver before a batch runs again after a Redis server change, and before a
    starting driver's first batch (a master may have gone back while no driver ran): a master
    of an ID tag that went back may have lost claims whose commits survived on the
    namespace's master; the replay reads those chunks from the backup and claims nothing, so a
    later copy would find no claim. ``HSETNX`` with :data:`SEEN_MARK` (the origin is not kept
    in the backup): nothing else can hold those fields, the lost claim had won its ``HSETNX``.
    """
    home = Keyspace(namespace)
    store = store_for(client)
    newest = store.hget(home.generations, str(generation)) or b"0"
    total = 0
    for stage in stages:
        inputs = _committed_inputs(store, home, stage, batch)
        by_tag: dict[int, list[tuple[str, bytes]]] = {}
        for rid in inputs:
            shard = shard_of(rid, shards)
            seen = id_tag(namespace, shard % tags, tags).seen(stage, generation, shard)
            by_tag.setdefault(shard % tags, []).append((seen, seen_field(rid, shards)))
        for k, fields in by_tag.items():
            tag = id_tag(namespace, k, tags)
            cmds = store_for(connect(tag.tag)).batch()
            for seen, name in fields:
                cmds.hsetnx(seen, name, SEEN_MARK)
            cmds.hsetnx(tag.generations, str(generation), newest)  # GC finds the generation
            cmds.execute()
        total += len(inputs)
    return total


def _committed_inputs(store: Store, home: Keyspace, stage: str, batch: int) -> list[bytes]:
    """The input IDs of every chunk of ``stage`` that its tasks committed in ``batch``."""
    inputs: list[bytes] = []
    pattern = f"{home.backup(glob_escape(stage), batch, 0)[:-1]}{SCAN_ALL}"
    for key in store.scan_iter(pattern, 1000):
        inputs.extend(replay(store.hgetall(key.decode())).inputs)
    return inputs

"""ID tags of layout 4: where a spread source stage's seen-IDs live on a Redis Cluster.

Designed in docs/concepts/dedup.md ("Spreading a source stage's seen-IDs over a Redis
Cluster"); the runtime does not use it yet: every namespace keeps layout 3. Under layout 4 a
source stage's seen shard ``s`` lives in ID tag ``s % T`` (``T`` pinned in the namespace's
meta, :data:`SEEN_TAGS_FIELD`), a partition scope of its own, ``of:{<namespace>:i<k>.<j>}``.
Tag ``k``'s suffix ``j`` is the smallest that hashes the tag into slots
``[k, k + 1) · 16384 / T``: masters own contiguous slot ranges, so the tags spread over them
in proportion to their slots instead of as luck spreads ``T`` names. A shard index stays in
one tag for every generation, so one script call on a tag can check an ID in every live
generation (``kernel/lua/claim_ids.lua``).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from onceflow.kernel.errors import OnceflowError
from onceflow.kernel.keyspace import Keyspace

SLOTS = 16384  # hash slots of a Redis Cluster
SEEN_TAGS_FIELD = "seen_tags"  # meta: T, the number of ID tags (layout 4)
TAGS_PER_MASTER = 32  # T = this x the masters the cluster has when the namespace is made
ORIGIN_BYTES = 8  # a claim's origin: source lane number (2 bytes) and offset (6 bytes)


def _slot(tag: str) -> int:
    from redis.crc import key_slot

    return int(key_slot(tag.encode()))


def slot_range(k: int, tags: int) -> range:
    """The slots ID tag ``k`` of ``tags`` hashes into."""
    return range(k * SLOTS // tags, (k + 1) * SLOTS // tags)


@cache
def id_tag_scope(namespace: str, k: int, tags: int) -> str:
    """The partition scope of ID tag ``k``: ``i<k>.<j>``, ``j`` the first that lands in range.

    A range holds ``16384 / T`` slots, so about ``T`` suffixes are tried; the bound is far
    beyond what CRC16 needs, and only a bug passes it.
    """
    if not 0 < tags <= SLOTS or not 0 <= k < tags:
        msg = f"ID tag {k} of {tags} is not valid; this is an Onceflow bug"
        raise OnceflowError(msg)
    wanted = slot_range(k, tags)
    for j in range(64 * tags + 4096):
        scope = f"i{k}.{j}"
        if _slot(f"{namespace}:{scope}") in wanted:
            return scope
    msg = f"no suffix puts ID tag {k} of {tags} in its slots; this is an Onceflow bug"
    raise OnceflowError(msg)


def id_tag(namespace: str, k: int, tags: int) -> Keyspace:
    """The keys of ID tag ``k`` (of ``tags``) of a namespace."""
    return Keyspace(namespace, id_tag_scope(namespace, k, tags))


def tag_of_shard(shard: int, tags: int) -> int:
    """The ID tag that holds seen shard ``shard`` in every generation."""
    return shard % tags


def origin(lane: int, offset: int) -> bytes:
    """A record's origin as a claim stores it: lane number (2 bytes), offset (6), big-endian.

    Where the record was read, the same at every replay (Spark's checkpoint keeps each
    batch's offsets): a claim that holds its own origin was made by an earlier attempt.
    """
    if not 0 <= lane < 1 << 16 or not 0 <= offset < 1 << 48:
        msg = f"origin (lane {lane}, offset {offset}) does not fit a claim"
        raise OnceflowError(msg)
    return lane.to_bytes(2, "big") + offset.to_bytes(6, "big")


def id_tags_for(client: Any) -> int:
    """``T`` for a new namespace: :data:`TAGS_PER_MASTER` per master serving slots now.

    A single Redis (no cluster) counts as one master: the tags then only cost, but work.
    """
    from redis.exceptions import ResponseError

    try:
        info = client.execute_command("CLUSTER", "INFO")
    except ResponseError:
        return TAGS_PER_MASTER
    text = info.decode() if isinstance(info, bytes) else str(info)
    sizes = [
        line.split(":", 1)[1] for line in text.splitlines() if line.startswith("cluster_size:")
    ]
    return TAGS_PER_MASTER * max(1, int(sizes[0])) if sizes else TAGS_PER_MASTER


def origin_of(lane: str, offset: int) -> bytes:
    """A record's origin from its source lane's name (a Kafka topic and partition) and offset.

    Lanes are not numbered in the namespace yet: the origin is 8 bytes of a BLAKE2b digest of
    both, so two records of different positions share an origin with chance 2^-64 (then a
    copy would be taken for its original's replay).
    """
    import hashlib

    text = f"{lane}@{offset}".encode()
    return hashlib.blake2b(text, digest_size=ORIGIN_BYTES).digest()

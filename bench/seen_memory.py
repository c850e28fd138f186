"""Redis memory per seen ID in the seen-ID layout (see onceflow.kernel.seen_layout).

Stores ``N`` random IDs in one generation of one receiver through the real commit path
(:func:`onceflow.dedup.commit.commit_chunk`: the addressing, the seen fields and the COMMIT
script, in chunks of the default size) against a fresh local Redis, then deletes everything
but the seen-ID shards and prints Redis ``used_memory`` growth per ID (and the sum of
``MEMORY USAGE`` over the shards, which is what ``bench/exactly_once.py`` reports): the
field is what the shard does not say of the ID, the value ``1``. (The owner-valued layout 1
this once compared against is gone: it took ~5-10 bytes more per ID.)

The first table is the default setting, 1,024 shards, at Redis's default
``hash-max-listpack-entries`` (128) and at 512 (what the test services use). A shard that
passes the limit is converted to a hash table for good, which the encoding column shows.

The second table (``--dense``) asks what a production generation needs: at 1,000 records/s
and the default 3 h bucket a generation holds ~10.8M IDs, ~10.5k per shard of 1,024. It
stores ``--dense-ids`` IDs in only as many shards as give that density (or the density of
65,536 shards), so the memory per ID, and Redis's time per committed ID (from ``INFO
commandstats``), are those of the full-size generation.

    python bench/seen_memory.py [--ids 100000 1000000] [--dense] [--dense-ids 500000]

Prints numbers only; always starts its own Redis (used_memory must hold nothing else).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from onceflow.dedup.addressing import Addressing, shards_of
from onceflow.dedup.commit import commit_chunk
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.session import TaskSession
from onceflow.kernel.keyspace import Keyspace, Kind
from onceflow.kernel.records import InRow
from onceflow.kernel.seen_layout import seen_width
from onceflow.kernel.store import store_for
from onceflow.testing.services import LocalRedis

STAGE = "events"
GENERATION = 5
PARTITION = 1
TS = 1_790_000_000_000
PER_GENERATION = 1_000 * 3 * 3600  # 1,000 records/s over the default 3 h bucket


@dataclass(frozen=True)
class Variant:
    name: str
    batch: int


VARIANTS = (Variant("seen-IDs", 7),)


@dataclass
class Measured:
    bytes_per_id: float  # used_memory growth / N
    usage_per_id: float  # sum of MEMORY USAGE over the shards / N
    redis_us_per_id: float  # Redis time in the commit script per ID
    hashtables: int  # shards converted to a hash table
    shards_used: int


def ids_in(n: int, shards: int, filled: int, seed: int) -> np.ndarray:
    """``n`` random IDs whose shard (of ``shards``) is below ``filled``, as ``(n, 16)``."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    if filled < shards:
        prefixes = np.arange(1 << 16)
        allowed = prefixes[prefixes % shards < filled]
        chosen = allowed[rng.integers(0, len(allowed), n)]
        raw[:, 0], raw[:, 1] = chosen >> 8, chosen & 0xFF
    return raw


def _used(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


def _drop_all_but_seen(client: Any, ks: Keyspace) -> None:
    for key in list(client.scan_iter(match=ks.pattern(), count=1000)):
        parsed = ks.parse(key)
        if parsed is None or parsed.kind is not Kind.SEEN:
            client.delete(key)


def store(client: Any, raw: np.ndarray, shards: int, variant: Variant, name: str) -> Measured:
    """Commit every ID of ``raw`` as one task would; measure what the seen-ID shards hold.

    The commits go through a connection of their own, closed before measuring: its query
    buffer (a chunk's arguments) would count in used_memory.
    """
    ks = Keyspace(name)
    before = _used(client)
    where = client.connection_pool.connection_kwargs
    writer = redis.Redis(host=where.get("host", "localhost"), port=where["port"])
    redis_us = _commit_all(writer, ks, raw, shards, variant)
    writer.close()
    writer.connection_pool.disconnect()
    _drop_all_but_seen(client, ks)
    grown = _used(client) - before
    keys = list(client.scan_iter(match=ks.seen_pattern(STAGE), count=1000))
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.memory_usage(key, samples=0)
        pipe.object("encoding", key)
    replies = pipe.execute()
    usage = sum(int(u or 0) for u in replies[0::2])
    hashtables = sum(1 for e in replies[1::2] if e in (b"hashtable", "hashtable"))
    n = len(raw)
    return Measured(grown / n, usage / n, redis_us / n, hashtables, len(keys))


def _commit_all(client: Any, ks: Keyspace, raw: np.ndarray, shards: int, variant: Variant) -> float:
    """Commit the IDs in chunks of the default size; return Redis's time in the script (us)."""
    config = DedupConfig(shards=shards)
    session = TaskSession(
        store_for(client),
        ks,
        config,
        "1",
        STAGE,
        variant.batch,
        PARTITION,
        token="1:1",
        generation=GENERATION,
        live=(GENERATION,),
    )
    client.set(ks.epoch, "1")
    client.set(ks.token(STAGE, PARTITION), "1:1")
    addressing = Addressing(ks, config)
    client.config_resetstat()
    blobs = [bytes(row) for row in raw]
    step = config.chunk_size
    for chunk, start in enumerate(range(0, len(blobs), step)):
        rows: list[InRow] = [(0, rid, TS, None, None) for rid in blobs[start : start + step]]
        _seq, conflicts, _other = commit_chunk(session, addressing, chunk, rows, [], {}, {}, TS)
        assert not conflicts, "random IDs collided"
    return float(client.info("commandstats").get("cmdstat_evalsha", {}).get("usec", 0))


def run(
    client: Any, n: int, shards: int, filled: int, listpack: int, seed: int
) -> dict[str, Measured]:
    client.config_set("hash-max-listpack-entries", listpack)
    raw = ids_in(n, shards, filled, seed)
    assert len(np.unique(shards_of(raw, shards))) <= filled
    for v in VARIANTS:  # scripts loaded, buffers grown: what stays is the data
        client.flushall()
        store(client, raw[:5000], shards, v, "seen-bench-warm-up")
    out = {}
    for v in VARIANTS:
        client.flushall()
        out[v.name] = store(client, raw, shards, v, f"seen-bench-{seed}")
    client.flushall()
    return out


def _row(label: str, found: dict[str, Measured], timing: bool) -> str:
    cells = []
    for v in VARIANTS:
        m = found[v.name]
        cell = f"{m.bytes_per_id:6.1f} ({m.usage_per_id:5.1f})"
        if timing:
            cell += f" {m.redis_us_per_id:5.2f}us"
        cells.append(f"{cell:>{28 if timing else 20}}")
    some = found[VARIANTS[-1].name]
    encoding = (
        "listpack"
        if some.hashtables == 0
        else f"hashtable {some.hashtables}/{some.shards_used}"
        if some.hashtables < some.shards_used
        else "hashtable"
    )
    return f"{label:<48}" + "".join(cells) + f"  {encoding}"


def header(timing: bool) -> str:
    width = 28 if timing else 20
    return f"{'':<48}" + "".join(f"{v.name:>{width}}" for v in VARIANTS) + "  encoding"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ids", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--shards", type=int, default=1024)
    parser.add_argument("--listpack", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--dense", action="store_true", help="also the production-size table")
    parser.add_argument("--dense-ids", type=int, default=500_000)
    args = parser.parse_args()

    with LocalRedis() as redis_server:
        client = redis.Redis(port=redis_server.port)
        client.config_set("appendonly", "no")  # its buffers would count in used_memory
        print(
            f"bytes per seen ID: used_memory growth / N (MEMORY USAGE sum / N); "
            f"field width {seen_width(args.shards)} B at {args.shards} shards"
        )
        print(header(False))
        for listpack in args.listpack:
            for n in args.ids:
                found = run(client, n, args.shards, args.shards, listpack, seed=n)
                label = f"N={n:,} listpack<={listpack} ({n / args.shards:,.0f}/shard)"
                print(_row(label, found, False), flush=True)
        if not args.dense:
            return
        print()
        print(
            f"a production generation: {PER_GENERATION:,} IDs (1,000 rec/s x 3 h), emulated "
            f"with {args.dense_ids:,} IDs at its density; Redis time per committed ID"
        )
        print(header(True))
        for shards, listpacks in ((1024, (512, 16384)), (65536, (128, 512))):
            per_shard = PER_GENERATION / shards
            filled = max(1, round(args.dense_ids / per_shard))
            for listpack in listpacks:
                found = run(client, args.dense_ids, shards, filled, listpack, seed=shards)
                label = f"{shards} shards ({per_shard:,.0f}/shard) listpack<={listpack}"
                print(_row(label, found, True), flush=True)


if __name__ == "__main__":
    main()

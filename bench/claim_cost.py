"""What the designed claim step would cost Redis per ID (docs/concepts/dedup.md, layout 4).

The design spreads a source stage's seen-IDs over ``T`` ID tags and, instead of one commit
script marking a chunk's IDs, sends one *claim* call per tag the chunk touches; with design
option (a) (no Bloom filters for such receivers) each call checks every ID in the ``g`` live
generations of its tag and marks it in the newest, its value the record's origin and
fingerprint (12 bytes). This measures that work on a fresh local Redis (all tags on one
server: the Redis time per ID is what a cluster divides among its masters), with a prototype
of the claim script, against today's per-ID work (one call per chunk, one generation, a
4-byte value):

* the Redis main thread's CPU per claimed ID (``INFO cpu``) and the wall time per chunk;
* the bytes per ID of the newest generation's shards (``MEMORY USAGE``).

Each older generation is filled first with ``--per-shard`` IDs in each of 1,024 shards (the
listpack density a sized layout keeps, ~300 at most); the newest takes ``--ids`` new IDs in
chunks of ``--chunk``.

    python bench/claim_cost.py [--ids 200000] [--chunk 2500] [--per-shard 200]
        [--tags 1 16 96] [--generations 1 3 9]

Prints numbers only; always starts its own Redis. The prototype is not the pipeline's code.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
import redis

from onceflow.testing.services import LocalRedis

SHARDS = 1024
FIELD_BYTES = 15  # a seen field at 1,024 shards (onceflow.kernel.keyspace.seen_width)
CLAIM_VALUE_BYTES = 12  # origin (lane number 2 + offset 6 bytes) and fingerprint (4 bytes)
TODAY_VALUE_BYTES = 4  # a source record's fingerprint

# KEYS: for each ID, its shard in each of the g generations, newest first (n x g keys, the
# same key named once per ID; plain keys keep the prototype short). ARGV: 1 n, 2 g, 3 fields
# blob, 4 values blob. Returns, per ID, false (claimed now) or the value found.
CLAIM = """
local n, g = tonumber(ARGV[1]), tonumber(ARGV[2])
local w, v = #ARGV[3] / n, #ARGV[4] / n
local out = {}
for j = 1, n do
  local id = string.sub(ARGV[3], w * j - w + 1, w * j)
  local found = false
  for k = 2, g do
    found = redis.call('HGET', KEYS[(j - 1) * g + k], id)
    if found then break end
  end
  if not found then
    local own = KEYS[(j - 1) * g + 1]
    if redis.call('HSETNX', own, id, string.sub(ARGV[4], v * j - v + 1, v * j)) == 0 then
      found = redis.call('HGET', own, id)
    end
  end
  out[j] = found
end
return out
"""


def key(tags: int, generation: int, shard: int) -> str:
    return f"of:{{bench:i{shard % tags}}}:seen:src:{generation}:{shard}"


def fill(client: Any, generations: int, per_shard: int, tags: int, rng: Any) -> None:
    """Older generations (1..g-1), ``per_shard`` random fields in each shard."""
    for generation in range(1, generations):
        pipe = client.pipeline(transaction=False)
        for shard in range(SHARDS):
            fields = rng.bytes(FIELD_BYTES * per_shard)
            mapping = {fields[i : i + FIELD_BYTES]: b"1" for i in range(0, len(fields), 15)}
            pipe.hset(key(tags, generation, shard), mapping=mapping)
        pipe.execute()


def main_thread_cpu(client: Any) -> float:
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])


def run(client: Any, args: argparse.Namespace, tags: int, generations: int, today: bool) -> str:
    """Claim ``--ids`` new IDs; one line of numbers."""
    client.flushall()
    rng = np.random.default_rng(1)
    fill(client, generations, args.per_shard, tags, rng)
    script = client.register_script(CLAIM)
    value_bytes = TODAY_VALUE_BYTES if today else CLAIM_VALUE_BYTES
    newest = generations
    cpu0, wall = main_thread_cpu(client), 0.0
    for _ in range(args.ids // args.chunk):
        shards = rng.integers(0, SHARDS, args.chunk)
        fields = rng.bytes(FIELD_BYTES * args.chunk)
        by_tag: dict[int, list[int]] = {}
        for j, shard in enumerate(shards):
            by_tag.setdefault(int(shard) % tags, []).append(j)
        t0 = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for members in by_tag.values():
            keys = [
                key(tags, newest - k, int(shards[j])) for j in members for k in range(generations)
            ]
            blob = b"".join(fields[j * FIELD_BYTES : (j + 1) * FIELD_BYTES] for j in members)
            values = rng.bytes(value_bytes * len(members))
            script(keys=keys, args=[len(members), generations, blob, values], client=pipe)
        pipe.execute()
        wall += time.perf_counter() - t0
    cpu = main_thread_cpu(client) - cpu0
    claimed = (args.ids // args.chunk) * args.chunk
    size = sum(
        int(client.memory_usage(key(tags, newest, s), samples=0) or 0) for s in range(SHARDS)
    )
    name = "today (one call, one generation)" if today else f"claims, {tags} tags"
    return (
        f"{name:<34} {generations:>4} {1e6 * cpu / claimed:>12.2f} "
        f"{1e3 * wall / (args.ids // args.chunk):>10.1f} {size / claimed:>10.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=200_000)
    parser.add_argument("--chunk", type=int, default=2_500)
    parser.add_argument("--per-shard", type=int, default=200)
    parser.add_argument("--tags", type=int, nargs="+", default=[1, 16, 96])
    parser.add_argument("--generations", type=int, nargs="+", default=[1, 3, 9])
    args = parser.parse_args()
    with LocalRedis() as server:
        client = redis.Redis.from_url(server.url)
        print(
            f"{args.ids:,} new IDs in chunks of {args.chunk:,}, 1,024 shards, "
            f"{args.per_shard} IDs per shard in each older generation (pid {os.getpid()})"
        )
        print(f"{'':<34} {'gens':>4} {'Redis us/ID':>12} {'ms/chunk':>10} {'bytes/ID':>10}")
        print(run(client, args, 1, 1, today=True))
        for generations in args.generations:
            for tags in args.tags:
                print(run(client, args, tags, generations, today=False), flush=True)


if __name__ == "__main__":
    main()

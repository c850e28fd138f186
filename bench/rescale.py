"""Time and Redis memory of a rescale and of a savepoint of N keys, beside a plain copy.

Builds a stopped pipeline's namespace in a fresh local Redis, as a run at parallelism 4 leaves
it: one keyed stage (``count``) whose N keys each hold a count in the partition the exchange
sends them to, an event-time timer for every tenth key, and ``--ids`` seen-IDs spread over
the partitions' scopes. Then it takes a savepoint (``onceflow savepoint create``) and restores it
into another namespace, rescales 4 -> 7 -> 2, and prints, for each, the seconds,
Redis ``used_memory`` before and after (seen-IDs are copied into every new partition), and the
Python process's peak RSS. The baseline beside it is the floor of any move of that data: a
plain copy of every state, timer and seen-ID key to new names (DUMP + RESTORE, one pipeline
per 1,000 keys), then deleting the originals, on the same Redis.

    python bench/rescale.py [--keys 1000000] [--ids 200000] [--rounds 3]

Prints numbers only; always starts its own Redis.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import tempfile
import time
from typing import Any

import page
import redis

from onceflow.dedup.config import DedupConfig
from onceflow.kernel import codec
from onceflow.kernel.key_hash import exchange_partition
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.scopes import PLAN_FIELD, SCOPED_FIELD, Scopes
from onceflow.kernel.seen_layout import LAYOUT, LAYOUT_FIELD, seen_field, shard_of
from onceflow.operations import savepoint
from onceflow.runtime.driver.rescale import rescale
from onceflow.runtime.driver.rescale_staging import Layout, scope_shards
from onceflow.testing.services import LocalRedis

SECTION = "## Rescale"
STAGE = "count"
GENERATION = 7
TS = 1_790_000_000_000


def build(client: Any, namespace: str, keys: int, ids: int, parallelism: int = 4) -> None:
    """A stopped namespace at ``parallelism`` with ``keys`` counts and ``ids`` seen-IDs."""
    home = Keyspace(namespace)
    shards = DedupConfig().shards
    plan = {"stages": {"events": ["events"], STAGE: [STAGE]}, "parallelism": parallelism}
    client.hset(
        home.meta,
        mapping={
            "parallelism": parallelism,
            "shards": shards,
            "bucket_ms": DedupConfig().bucket_ms,
            SCOPED_FIELD: json.dumps([STAGE]),
            LAYOUT_FIELD: LAYOUT,
            PLAN_FIELD: json.dumps(plan, sort_keys=True),
        },
    )
    scopes = Scopes(namespace, frozenset([STAGE]), parallelism)
    per_scope = scope_shards(Layout(shards, parallelism), parallelism)
    rng = random.Random(3)
    pipe = client.pipeline(transaction=False)
    for i in range(keys):
        kb = codec.encode(f"user-{i}")
        p = exchange_partition(kb, parallelism)
        ks = scopes.keyspace(STAGE, p)
        pipe.hset(ks.state(STAGE, p), kb, codec.encode(i % 1000))
        if i % 10 == 0:
            pipe.zadd(ks.timers("event", STAGE, p), {kb: TS + i})
        if i % 5000 == 4999:
            pipe.execute()
    for _ in range(ids):
        rid = rng.randbytes(16)
        p = rng.randrange(parallelism)
        ks = scopes.keyspace(STAGE, p)
        seen = ks.seen(STAGE, GENERATION, shard_of(rid, per_scope))
        pipe.hset(seen, seen_field(rid, per_scope), b"1")
    for p in range(parallelism):
        ks = scopes.keyspace(STAGE, p)
        pipe.set(ks.filter_seq(STAGE), 10 + p)
        pipe.hset(ks.generations, str(GENERATION), TS)
        pipe.hset(ks.stats(STAGE), mapping={"records": 100, "duplicates": 3})
    pipe.execute()


def _used(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


def _plain_copy(client: Any, namespace: str) -> float:
    """The baseline: DUMP + RESTORE every scope key to a new name, then delete the old."""
    started = time.perf_counter()
    keys = list(client.scan_iter(f"of:{{{namespace}:*", count=1000))
    for i in range(0, len(keys), 1000):
        step = keys[i : i + 1000]
        pipe = client.pipeline(transaction=False)
        for k in step:
            pipe.dump(k)
        dumps = pipe.execute()
        pipe = client.pipeline(transaction=False)
        for k, blob in zip(step, dumps, strict=True):
            pipe.restore(k + b":copy", 0, blob, replace=True)
        pipe.delete(*step)
        pipe.execute()
    return time.perf_counter() - started


def _round(keys: int, ids: int) -> list[dict[str, Any]]:
    rows = []
    with LocalRedis() as server:
        client = redis.Redis.from_url(server.url)
        build(client, "bench", keys, ids)
        rows += _savepoint(client)
        for target in (7, 2):
            before = _used(client)
            started = time.perf_counter()
            report = rescale(client, "bench", target)
            seconds = time.perf_counter() - started
            rows.append(
                {
                    "move": f"{report.before} -> {report.after}",
                    "seconds": seconds,
                    "keys": report.keys,
                    "before_mb": before / 1e6,
                    "after_mb": _used(client) / 1e6,
                }
            )
        rows.append({"move": "plain copy (baseline)", "seconds": _plain_copy(client, "bench")})
    return rows


def _savepoint(client: Any) -> list[dict[str, Any]]:
    """``onceflow savepoint create`` of the namespace, then ``restore`` into another one."""
    with tempfile.TemporaryDirectory() as work:
        checkpoint = os.path.join(work, "checkpoint")
        os.makedirs(os.path.join(checkpoint, "commits"))
        folder = os.path.join(work, "savepoint")
        before = _used(client)
        started = time.perf_counter()
        made = savepoint.create(client, "bench", folder, checkpoint)
        create_s = time.perf_counter() - started
        size = os.path.getsize(os.path.join(folder, savepoint.DATA)) / 1e6
        started = time.perf_counter()
        savepoint.restore(client, folder, "bench-copy", os.path.join(work, "restored"))
        restore_s = time.perf_counter() - started
        after = _used(client)
        for key in client.scan_iter("of:{bench-copy*", count=1000):
            client.unlink(key)
    return [
        {"move": f"savepoint create ({made.keys:,} keys, {size:.0f} MB file)",
         "seconds": create_s, "before_mb": before / 1e6, "after_mb": before / 1e6},
        {"move": "savepoint restore (another namespace)", "seconds": restore_s,
         "before_mb": before / 1e6, "after_mb": after / 1e6},
    ]  # fmt: skip


def table(runs: list[list[dict[str, Any]]], args: argparse.Namespace) -> list[str]:
    """The printed table (Markdown), one row per move, median and spread of the rounds."""
    lines = [
        f"Savepoint and rescale of {args.keys:,} keys (every 10th with a timer) and "
        f"{args.ids:,} seen-IDs, "
        f"{len(runs)} rounds:",
        "",
        "| move | seconds, median (min-max) | Redis MB before / after |",
        "|---|---|---|",
    ]
    for i, first in enumerate(runs[0]):
        secs = [r[i]["seconds"] for r in runs]
        spread = f"{statistics.median(secs):.2f} ({min(secs):.2f}-{max(secs):.2f})"
        mem = f"{first['before_mb']:.0f} / {first['after_mb']:.0f}" if "before_mb" in first else "-"
        lines.append(f"| {first['move']} | {spread} | {mem} |")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    lines += ["", f"Peak RSS of the process (the builder and the rescales): {rss:.0f} MB."]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--ids", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--markdown", help="also write the section to this file")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    runs = [_round(args.keys, args.ids) for _ in range(args.rounds)]
    lines = table(runs, args)
    print("\n".join(lines))
    if args.markdown:
        command = (
            f"Generated by `python bench/rescale.py --keys {args.keys} --ids {args.ids} "
            f"--rounds {args.rounds} --markdown {args.markdown}` on {time.strftime('%Y-%m-%d')} "
            f"({os.cpu_count()} cores, load average {load:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end; one local Redis). A stopped namespace as a "
            "run at parallelism 4 leaves it, rescaled 4 -> 7 -> 2 by `onceflow rescale`'s "
            "code; the baseline is a plain copy of the same Redis keys (DUMP + RESTORE, then "
            "delete), the floor of any move. The seen-IDs are copied into every new "
            "partition (an ID does not say its key), hence the memory after 4 -> 7."
        )
        page.replace_section(args.markdown, SECTION, [command, "", *lines])
        print(f"\nwrote {args.markdown}")


if __name__ == "__main__":
    main()

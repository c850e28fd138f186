"""What one commit of N MB of outputs costs Redis: the numbers behind ``DedupConfig.chunk_bytes``.

A chunk's outputs travel to Redis as one argument of the commit script
(:func:`onceflow.dedup.commit.commit_chunk`, the real path: fence, seen-marks, backup field,
journal, counters). Redis runs one script at a time, so while it runs every other client
waits: other tasks' commits, lookups, the driver. This measures, against a fresh local Redis
with AOF on (``appendfsync everysec``), for commits carrying outputs of each size:

* the commit's wall time as the task sees it (sending the blob included);
* Redis's own time in the script (``INFO commandstats``, per call);
* the longest a concurrent ``PING`` waited while the commits ran: how long Redis stopped
  answering anyone else (the script, the copy of the blob into the hash, the AOF write of it
  in the main thread).

    python bench/commit_bytes.py [--sizes-mb 1 2 4 8 16 32 64] [--repeat 5]

Prints numbers only; always starts its own Redis.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Any

import redis

from onceflow.dedup.addressing import Addressing
from onceflow.dedup.commit import commit_chunk
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.session import TaskSession
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import InRow, Output
from onceflow.kernel.store import store_for
from onceflow.testing.services import LocalRedis

STAGE = "events"
TS = 1_790_000_000_000
DOC = 250_000  # bytes per output: the tester's JSON documents


class Pinger(threading.Thread):
    """PINGs Redis back to back and keeps the longest wait while ``armed``."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis(port=port)
        self.armed = False
        self.longest = 0.0
        self.stop = False

    def run(self) -> None:
        while not self.stop:
            start = time.perf_counter()
            self.client.ping()
            took = time.perf_counter() - start
            if self.armed:
                self.longest = max(self.longest, took)
            time.sleep(0.0005)


def session_for(client: Any, ks: Keyspace, batch: int) -> tuple[TaskSession, Addressing]:
    config = DedupConfig()
    session = TaskSession(
        store_for(client),
        ks,
        config,
        "1",
        STAGE,
        batch,
        0,
        token="1:1",
        generation=0,
        live=(0,),
    )
    return session, Addressing(ks, config)


def commit_of(client: Any, ks: Keyspace, batch: int, size: int) -> float:
    """One commit carrying ``size`` bytes of outputs; return its wall time (s)."""
    session, addressing = session_for(client, ks, batch)
    n = max(1, size // DOC)
    rows: list[InRow] = [(0, os.urandom(16), TS, None, None) for _ in range(n)]
    value = os.urandom(size // n)
    outputs = [Output(0, os.urandom(16), TS, None, value) for _ in range(n)]
    start = time.perf_counter()
    _seq, conflicts = commit_chunk(session, addressing, 0, rows, outputs, {}, {}, TS)
    took = time.perf_counter() - start
    assert not conflicts
    return took


def measure(port: int, size_mb: float, repeat: int, pinger: Pinger) -> dict[str, float]:
    client = redis.Redis(port=port)
    ks = Keyspace(f"commit-bytes-{size_mb}")
    client.set(ks.epoch, "1")
    client.set(ks.token(STAGE, 0), "1:1")
    size = int(size_mb * (1 << 20))
    commit_of(client, ks, 10_000, size)  # warm: script loaded, buffers grown
    client.config_resetstat()
    walls, pings = [], []
    for batch in range(repeat):
        pinger.longest = 0.0
        pinger.armed = True
        walls.append(commit_of(client, ks, batch, size))
        time.sleep(0.05)  # the AOF write happens after the script, before the next loop
        pinger.armed = False
        pings.append(pinger.longest)
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    calls = max(1, int(stats.get("calls", 1)))
    for key in client.scan_iter(match=ks.pattern(), count=1000):
        client.unlink(key)
    return {
        "wall_ms": statistics.median(walls) * 1000,
        "script_ms": float(stats.get("usec", 0)) / calls / 1000,
        "ping_ms": statistics.median(pings) * 1000,
        "ping_max_ms": max(pings) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with LocalRedis() as server:
        pinger = Pinger(server.port)
        pinger.start()
        print(
            f"one commit carrying N MB of outputs ({DOC // 1000} KB each), Redis with AOF "
            "everysec; medians of",
            args.repeat,
        )
        print(f"{'MB':>6} {'commit wall ms':>15} {'script ms':>10} {'PING wait ms':>13} {'max':>7}")
        for size in args.sizes_mb:
            m = measure(server.port, size, args.repeat, pinger)
            print(
                f"{size:>6g} {m['wall_ms']:>15.1f} {m['script_ms']:>10.1f} "
                f"{m['ping_ms']:>13.1f} {m['ping_max_ms']:>7.1f}",
                flush=True,
            )
        pinger.stop = True


if __name__ == "__main__":
    main()

"""The torture run for the stateful operators: Nexmark queries under random faults.

The queries with user state and timers (q4, q6: ``Stream.process`` + a combine), a windowed
join (q8: ``co_group``), a join with a table (q20: ``join_table``) and an interval join
(``early_bids``) read the generator's events in waves while the whole run (driver, JVM,
Python workers) is killed -9 at random moments (``torture.KillTimer``), optionally with
Redis's host crashing under it (``torture.RedisHostCrashes``: the last second of
acknowledged writes lost) or the Kafka broker killed and restarted mid-run. The input is
what production sends: each event's ID (a UUID) as a 16-byte header, a text header or a body
field (``NEXMARK_IDS=mixed`` in ``examples/nexmark/queries.py``); copies re-sent seconds or
hours later in Kafka time, to other partitions, a header ID as bytes or as text whichever the
original had (a UUID's text and its bytes are one ID); poison records (undecodable, an empty
ID header, an event the query's own functions reject, one stamped days ahead of the clock).
At the end the output topic, read ``read_committed`` by a plain consumer, must be the plain-Python
reference's answer (``examples/nexmark/reference.py``) over the events sent once each:
nothing lost, nothing twice; and the dead letters exactly the poison, each with its reason.

Seeded; run one query for a while with

    python -m tests.exactly_once.nexmark_torture --query q8 --minutes 10 --seed 3

(the suite's versions: ``test_nexmark_torture.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from examples.nexmark import reference
from examples.nexmark.events import Config, generate
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import read_topic
from onceflow.testing.harness import compare_counts
from onceflow.testing.hostcrash import CrashableRedis
from onceflow.testing.kafka import LocalKafka
from onceflow.testing.redis_cluster import LocalRedisCluster
from tests.exactly_once.faults import BrokerRestart, ClusterFailover
from tests.exactly_once.real_input import Run, Send, dead_letters
from tests.exactly_once.torture import CHUNK, HOUR, Torture

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
QUERIES_FILE = os.path.join(ROOT, "examples", "nexmark", "queries.py")
QUERIES = ("q4", "q6", "q8", "q20", "early_bids")
PARTITIONS = 4
ID_NAMESPACE = uuid.UUID("6f1c1c4e-6a55-4f0e-9a43-3c1e8f0b7a10")
REJECTED = "KeyError"  # an event without a type: every query's first filter reads e["type"]


@dataclass
class NexmarkTorture:
    """One seeded run of one query: the events sent, the poison, the faults made."""

    query: str
    t: Torture  # the kills, their accounting and the Redis host crashes (torture.py)
    events: list[dict[str, Any]]  # the generator's, in stream order
    sent: int = 0  # how many of them have been produced

    @property
    def run(self) -> Run:
        return self.t.run

    def wave(self, size: int, last: bool = False) -> None:
        """The next ``size`` events, copies of earlier ones, poison; closers if ``last``."""
        rng = self.t.rng
        new = self.events[self.sent : self.sent + size]
        # (place in the stream, send): a copy comes after its original, which may be in
        # this wave; poison anywhere
        placed = [
            (float(i), self._send(e, e["date_time"], rng.randrange(PARTITIONS)))
            for i, e in enumerate(new)
        ]
        for j in rng.sample(range(self.sent + len(new)), len(new) // 15):
            old = self.events[j]
            after = max(j - self.sent, 0)
            later = old["date_time"] + (
                rng.randrange(1, 30) * 1000 if rng.random() < 0.5 else 2 * HOUR
            )
            # re-sent by another producer, maybe: a header ID as bytes or as text (a copy's
            # key and value must be the original's bytes: the body's ID stays in the body)
            send = self._send(old, later, rng.randrange(PARTITIONS), rng.randrange(2))
            placed.append((rng.uniform(after, len(new)), send))
        for _ in range(max(1, len(new) // 300)):
            placed.append((rng.uniform(0, len(new)), self._poison()))
        sends = [send for _, send in sorted(placed, key=lambda p: p[0])]
        self.sent += len(new)
        if last:  # every lane a minute past the end: every window and auction closes
            end = max(e["date_time"] for e in self.events[: self.sent]) + 60_000
            for p in range(PARTITIONS):
                closer = {"type": "person", "id": -1 - p, "name": "closer", "event_id": f"end-{p}"}
                closer["date_time"] = end
                self.events.insert(self.sent, closer)
                self.sent += 1
                sends.append(self._send(closer, end, p))
        self.run.produce(sends)

    def _send(self, e: dict[str, Any], ts: int, partition: int, header: int | None = None) -> Send:
        """The event's ID (a UUID) as 16 header bytes, header text or the body's ``msg_id``
        text, by the ID; ``header`` (0: bytes, 1: text) for a copy of one sent with a header."""
        uid = uuid.uuid5(ID_NAMESPACE, e["event_id"])
        way = uid.int % 3
        if way < 2 and header is not None:
            way = header
        if way == 0:
            return Send(e, partition, [("onceflow-id", uid.bytes)], ts)
        if way == 1:
            return Send(e, partition, [("onceflow-id", str(uid).encode())], ts)
        return Send({**e, "msg_id": str(uid)}, partition, None, ts)

    def _poison(self) -> Send:
        rng, poison = self.t.rng, self.run.poison
        marker = f"poison-{uuid.uuid4().hex[:10]}"
        at = self.events[max(self.sent - 1, 0)]["date_time"]
        partition = rng.randrange(PARTITIONS)
        body: dict[str, Any] = {"event_id": marker, "date_time": at, "msg_id": marker}
        kind = rng.randrange(4)
        if kind == 0:
            poison[marker] = "cannot decode as json"
            return Send(f"{{not json {marker}".encode(), partition, None, at)
        if kind == 1:
            poison[marker] = "header is empty"
            person = {"type": "person", "id": 7, "name": "x", "event_id": marker, "date_time": at}
            return Send(person, partition, [("onceflow-id", b"")], at)
        if kind == 2:  # no type: the query's first filter raises
            poison[marker] = REJECTED
            return Send(body, partition, None, at)
        poison[marker] = "further ahead of the clock"
        ahead = int(time.time() * 1000) + 72 * HOUR
        return Send({**body, "type": "person", "id": 7, "date_time": ahead}, partition, None, at)

    def attempt(self, kill_after: float | None, echo: Any = None) -> None:
        """One run (``Torture.attempt``: with the broker killed and restarted if set)."""
        self.t.attempt(kill_after, echo)


def nexmark_torture(
    query: str,
    bootstrap: str,
    redis_url: str,
    workdir: str,
    *,
    seed: int,
    kills: int,
    wave: int,
    cap: int = 300,
    min_kill_s: float = 0.0,
    max_kill_s: float = 3.0,
    redis_host: CrashableRedis | None = None,
    broker: LocalKafka | None = None,
    redis_cluster: LocalRedisCluster | None = None,
    echo: Any = None,
    on_attempt: Any = None,
) -> NexmarkTorture:
    """A first wave of ``wave`` events, ``kills`` killed attempts each followed by half a
    wave more, then the closers and a final run to the end; not checked (see :func:`check`).
    ``broker``: killed -9 and restarted in each attempt; ``redis_cluster``: one of its
    masters failed over in each attempt (``redis_url`` must name it);
    ``on_attempt`` is called with the
    torture (:class:`~tests.exactly_once.torture.Torture`) after each attempt.
    """
    if query not in QUERIES:
        raise ValueError(f"query must be one of {QUERIES}, got {query!r}")
    rng = random.Random(seed)
    name = f"nxt-{query}-{seed}-{uuid.uuid4().hex[:6]}"
    env = {
        "NEXMARK_QUERY": query,
        "NEXMARK_TOPIC": f"{name}-in",
        "NEXMARK_OUT": f"{name}-out",
        "NEXMARK_PIPELINE": name,
        "NEXMARK_IDS": "mixed",
        # several commits per task, so that a kill often lands between two of them
        "NEXMARK_CHUNK_SIZE": str(CHUNK),
        "PYTHONPATH": ROOT,
    }
    run = Run(
        name,
        bootstrap,
        redis_url,
        workdir,
        PARTITIONS,
        extra_env=env,
        cap=cap,
    )
    base_ts = (int(time.time() * 1000) // HOUR - 4) * HOUR
    total = wave + kills * (wave // 2)
    events = list(generate(Config(events=total, seed=seed, start_ms=base_ts)))
    t = Torture(run, seed, rng, base_ts, redis_host=redis_host, pipeline=QUERIES_FILE)
    t.broker, t.redis_cluster, t.on_attempt = broker, redis_cluster, on_attempt
    nt = NexmarkTorture(query, t, events)
    nt.wave(wave, last=kills == 0)
    for i in range(kills):
        nt.attempt(rng.uniform(min_kill_s, max_kill_s), echo)
        nt.wave(wave // 2, last=i == kills - 1)
    nt.attempt(None, echo)
    return nt


def check(nt: NexmarkTorture) -> dict[str, int]:
    """The output topic against the reference over the events sent; the dead letters."""
    run = nt.run
    events = [e for e in nt.events[: nt.sent]]
    records = read_topic(KafkaSettings(run.bootstrap), f"{run.name}-out")
    by_id: dict[bytes, set[bytes]] = defaultdict(set)
    for rec in records:
        by_id[rec.headers["onceflow-id"]].add(rec.value or b"")
    assert all(len(v) == 1 for v in by_id.values()), "an output ID was written with two values"
    if nt.query == "q4":  # running means: each category's last is over all its auctions
        ordered = sorted(records, key=lambda r: (r.partition, r.offset))
        last = {int(r.key or b"0"): json.loads(r.value or b"0") for r in ordered}
        want = reference.q4(events)
        assert set(last) == set(want), f"categories: {sorted(last)} != {sorted(want)}"
        wrong = {c: (last[c], m) for c, m in want.items() if abs(last[c] - m) > 1e-6}
        assert not wrong, f"q4 means (got, want): {wrong}"
    else:
        got = Counter(json.dumps(json.loads(r.value or b"null"), sort_keys=True) for r in records)
        rows = getattr(reference, nt.query)(events)
        want = Counter(json.dumps(row, sort_keys=True) for row in rows)
        assert want, "the reference has rows"
        report = compare_counts(want, got)
        assert report.ok, f"{nt.query} output: {report}"
    dead = dead_letters(run)
    letters = 0
    for marker, reason in run.poison.items():
        found = [d for d in dead if marker in d["text"]]
        # an event without a type fails the first filter of each branch of the query (q8
        # reads persons and auctions by two): one letter per branch
        once = reason != REJECTED
        assert found and (len(found) == 1 or not once), f"{marker!r}: {len(found)} letters"
        wrong = [d["error"] for d in found if reason not in d["error"]]
        assert not wrong, f"reason {wrong[0]!r} lacks {reason!r}"
        letters += len(found)
    assert len(dead) == letters, f"unexpected dead letters: {dead}"
    return {
        "output_records": len(records),
        "events": nt.sent,
        "poison": len(run.poison),
        "kills": nt.t.kills,
        "kills_mid_batch": nt.t.in_flight,
        "redis_crashes": nt.t.redis_crashes,
        "batches_run_again": nt.t.reruns,
        "broker_restarts": nt.t.faults_made(BrokerRestart.kind),
        "redis_failovers": nt.t.faults_made(ClusterFailover.kind),
        # the last attempt is never killed: a restart in it was ridden out to the end
        "broker_restarts_ridden_out": int(_last_attempt_had(nt.t, BrokerRestart.kind)),
    }


def _last_attempt_had(t: Torture, kind: str) -> bool:
    """Whether the last attempt (never killed) rode a background fault of ``kind`` out."""
    last = [f for f in t.background if f.kind == kind][-1:]
    return bool(last) and last[0].happened and not t.outcomes[-1].crashed


def main(argv: list[str] | None = None) -> int:
    """Seeded rounds of one query for ``--minutes``, each checked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--query", choices=QUERIES, default="q8")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--wave", type=int, default=1500)
    parser.add_argument("--redis-host-crash", action="store_true")
    parser.add_argument("--broker-restart", action="store_true")
    args = parser.parse_args(argv)
    from onceflow.testing.services import LocalRedis, modern_redis_binary

    deadline = time.monotonic() + args.minutes * 60
    with contextlib.ExitStack() as stack:
        host = None
        if args.redis_host_crash:
            host = stack.enter_context(CrashableRedis(binary=modern_redis_binary()))
        redis_url = host.url if host else stack.enter_context(LocalRedis()).url
        kafka = stack.enter_context(LocalKafka())
        seed = args.seed
        while time.monotonic() < deadline:
            workdir = tempfile.mkdtemp(prefix=f"onceflow-nxt-{seed}-")
            nt = nexmark_torture(
                args.query,
                kafka.bootstrap,
                redis_url,
                workdir,
                seed=seed,
                kills=args.kills,
                wave=args.wave,
                redis_host=host,
                broker=kafka if args.broker_restart else None,
            )
            try:
                facts = check(nt)
            except AssertionError as exc:
                print(f"{args.query} seed {seed}: FAILED ({workdir}): {exc}", flush=True)
                return 1
            print(f"{args.query} seed {seed}: exact ({facts})", flush=True)
            seed += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

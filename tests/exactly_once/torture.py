"""A randomized torture run: kill -9 the whole pipeline at random moments, feed it messy input.

Input arrives in waves on 4 partitions while the pipeline is killed (SIGKILL of every process
of the run: driver, JVM, Python workers) at random moments, several times; then a final run
finishes. The input holds what production sends: IDs as 16-byte and text headers and in the
body, copies re-sent seconds later and hours later (new Kafka timestamps, which are the event
times here, or a Kafka timestamp hours later with the original's event time in an
``onceflow-ts`` header: hours later in wall time only), and poison records (undecodable
payloads, an empty ID header, records the user's function rejects, an event stamped days
ahead by a producer with a wrong clock). An independent checker
(``tests.exactly_once.real_input.verify``) then reads keyed state, each user's last total,
the copy topic, every other sink (Parquet, JSON lines, PostgreSQL, Iceberg, each read back by
a reader of its own) and the dead letters: every event exactly once, every poison record a
dead letter with its reason.

With ``ids="positions"`` no record carries an ID: each one's ID is its place in the input
(topic, partition, offset), so a re-sent copy is a new record and counts again, and what is
checked is that every record of the topic counts exactly once across the kills.

With a :class:`~onceflow.testing.hostcrash.CrashableRedis` (``redis_host=``), Redis's *host*
crashes too, at random moments while the pipeline runs: the server is killed and its AOF cut
back into what it had not fsynced (``appendfsync everysec``: up to a second of acknowledged
writes), then it starts again on the same files. The run must ride each crash out (it runs
the batch again from what Redis kept) and the result must still be exact. With ``broker=``
the Kafka broker is killed -9 and started again in every attempt, with ``redis_cluster=`` a
master of that Redis Cluster is failed over in every attempt (:mod:`.faults`). With
``replay=True`` the dead letters' causes are then fixed and the letters replayed beside a
killed attempt (:mod:`.replays`).

Seeded and reproducible (the kill moments too, up to how far the run got by then):

    python -m tests.exactly_once.torture --minutes 10 --seed 7

runs against ``$REDIS_URL`` / ``$KAFKA_BOOTSTRAP_SERVERS`` or starts its own Redis and Apache
Kafka; ``--redis-host-crash`` crashes Redis's host too (a Redis 8 it starts). The test suite
runs short versions (``test_torture.py``).

Options: ``--process`` adds a process stage with state and timers (``per-user`` in
``tests/e2e_pipelines/totals.py``) and events it rejects by their content, in its element
function or in its timer, each after changing state: each must be one dead letter with its
reason, the stage's outputs those of the other events once each, a user's counts exactly
1..n; ``--docs 0.04`` gives that share of events a document of 0.5-1 MB (through the map,
the sinks and the process stage's state); ``--broker-restart`` kills -9 and restarts the
broker (one it starts) in every attempt; ``--sinks parquet,jsonl,iceberg,postgres`` adds
those sinks (a PostgreSQL it starts); ``--replay`` ends each round with the dead-letter
replay.
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
from dataclasses import dataclass, field
from typing import Any

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import read_topic
from onceflow.testing.harness import Outcome, compare_counts, run_pipeline
from onceflow.testing.hostcrash import CrashableRedis
from onceflow.testing.kafka import LocalKafka
from onceflow.testing.redis_cluster import LocalRedisCluster
from tests.exactly_once.faults import (
    BackgroundFault,
    BrokerRestart,
    ClusterFailover,
    background_faults,
    highest_batch,
)
from tests.exactly_once.real_input import (
    PIPELINE,
    SINKS,
    Run,
    Send,
    event,
    sinks_env,
    stats,
    verify,
)
from tests.exactly_once.replays import Replays, replay_dead_letters, replay_facts

HOUR = 3_600_000
REJECTED = {"reject": "rejected by per-user", "timer_reject": "timer-rejected"}
PARTITIONS = 4
CHUNK = 16  # records per atomic commit (the default 2,500 makes a task one commit)
SLOW_MS = 1  # per record: a task's commits spread over a good part of its batch's time


@dataclass
class Torture:
    """One seeded torture run's plan and what happened."""

    run: Run
    seed: int
    rng: random.Random
    base_ts: int
    sent: list[dict[str, Any]] = field(default_factory=list)
    positions: bool = False  # no IDs: a record's ID is its offset (see the module doc)
    outcomes: list[Outcome] = field(default_factory=list)
    kills: int = 0
    in_flight: int = 0  # kills that cut a micro-batch short (planned, not committed)
    redis_host: CrashableRedis | None = None  # crashed at random moments (see the module doc)
    redis_crashes: int = 0  # host crashes of Redis during runs
    reruns: int = 0  # batches a run ran again after Redis came back
    stops: list[str] = field(default_factory=list)  # a run's own error lines, before any kill
    startup_s: float | None = None  # an attempt's start to its first new micro-batch
    pipeline: str = PIPELINE  # the file run (the Nexmark torture runs its queries' file)
    rejects: bool = False  # send events the process stage rejects (see the module doc)
    docs: float = 0.0  # the share of events that carry a document of 0.5-1 MB
    # user -> (event_id, document length) of every event the process stage must count
    per_user: dict[str, list[tuple[str, int]]] = field(default_factory=lambda: defaultdict(list))
    broker: LocalKafka | None = None  # killed -9 and started again in every attempt
    redis_cluster: LocalRedisCluster | None = None  # a master failed over in every attempt
    background: list[BackgroundFault] = field(default_factory=list)  # made beside attempts
    extra_faults: Any = None  # attempt -> more background faults (the dead-letter replay)
    replays: Replays | None = None  # the dead-letter replay's, if it ran
    on_attempt: Any = None  # called with the torture after each attempt (progress lines)
    # Redis's host crashes in the runs to the end too, not only in the killed ones
    crash_always: bool = False

    def wave(self, size: int, poison: bool = True) -> None:
        """Produce ``size`` events, some re-sends of earlier ones, and (``poison``) a few
        poison records.

        A copy is re-sent seconds later, or two hours later in event time (its Kafka
        timestamp, the event time here), or two hours later in wall time only (its Kafka
        timestamp hours after the original's, its event time the original's in an
        ``onceflow-ts`` header, as a producer re-sending an old event stamps it).
        """
        rng, run = self.rng, self.run
        sends: list[Send] = []
        for _ in range(size):
            more = {}
            if self.docs and rng.random() < self.docs:
                more["body"] = document(rng)
            e = event(run, f"u{rng.randrange(50)}", rng.randrange(1, 9), **more)
            self.per_user[e["user"]].append((e["event_id"], len(more.get("body", ""))))
            ts = self.base_ts + len(self.sent) * 10
            self.sent.append({**e, "_ts": ts})
            sends.append(self._send(e, ts, rng.randrange(PARTITIONS)))
        if self.rejects:
            for _ in range(max(1, size // 200)):
                sends.insert(rng.randrange(len(sends) + 1), self._rejected())
        for old in rng.sample(self.sent, min(len(self.sent), size // 15)):
            e = {k: v for k, v in old.items() if k != "_ts"}
            if self.positions:  # a copy without an ID is a record of its own
                run.expected[e["user"]] += e["amount"]
                run.events[e["event_id"]] += 1
            when = rng.random()
            later = old["_ts"] + (rng.randrange(1, 30) * 1000 if when < 0.5 else 2 * HOUR)
            event_ts = old["_ts"] if when >= 0.75 else None  # hours later in wall time only
            copy = self._send(e, later, rng.randrange(4), event_ts)
            sends.insert(rng.randrange(len(sends) + 1), copy)
        for _ in range(max(1, size // 400) if poison else 0):
            sends.insert(rng.randrange(len(sends) + 1), self._poison())
        run.produce(sends)

    def _send(
        self, e: dict[str, Any], ts: int, partition: int, event_ts: int | None = None
    ) -> Send:
        """The same event always carries its ID the same way (a producer's habit);
        ``event_ts``: its event time in an ``onceflow-ts`` header, its Kafka timestamp ``ts``."""
        stamp = [] if event_ts is None else [("onceflow-ts", str(event_ts).encode())]
        if self.positions:
            return Send(e, partition, stamp or None, ts)
        uid = uuid.UUID(e["event_id"])
        way = uid.int % 3
        if way == 0:
            headers = [("onceflow-id", uid.bytes)]
        elif way == 1:
            headers = [("onceflow-id", str(uid).encode())]
        else:  # the ID comes from the body (TOTALS_ID_FIELD=if-present: the others' is None)
            return Send({**e, "id": e["event_id"]}, partition, stamp or None, ts)
        return Send(e, partition, headers + stamp, ts)

    def _rejected(self) -> Send:
        """An event the process stage rejects, in its element function or in its timer: it
        counts everywhere else (copy, totals), and is a dead letter of per-user once."""
        rng, run = self.rng, self.run
        kind = rng.choice(("reject", "timer_reject"))
        e = event(run, f"u{rng.randrange(50)}", rng.randrange(1, 9), **{kind: True})
        run.poison[e["event_id"]] = REJECTED[kind]
        if kind == "timer_reject":  # its element ran: counted, an output
            self.per_user[e["user"]].append((e["event_id"], 0))
        ts = self.base_ts + len(self.sent) * 10
        self.sent.append({**e, "_ts": ts})  # re-sent later, maybe: a copy, no second letter
        return self._send(e, ts, rng.randrange(PARTITIONS))

    def _poison(self) -> Send:
        kind = self.rng.randrange(4)
        marker = f"poison-{uuid.uuid4().hex[:10]}"
        ts = self.base_ts + len(self.sent) * 10
        partition = self.rng.randrange(PARTITIONS)
        if kind == 0:
            self.run.poison[marker] = "cannot decode as json"
            return Send(f"{{not json {marker}".encode(), partition, None, ts)
        if kind == 1:
            self.run.poison[marker] = "header is empty"
            body = {"event_id": marker, "user": "u0", "amount": 100}
            return Send(body, partition, [("onceflow-id", b"")], ts)
        # an ID of its own in the body (TOTALS_ID_FIELD=if-present), so that what is tested is
        # the fault below, not a missing ID
        body = {"event_id": marker, "user": "u0", "amount": 100, "id": marker}
        if kind == 2:
            self.run.poison[marker] = "asked to blow up"
            return Send({**body, "blow_up": True}, partition, None, ts)
        # a producer whose clock is 3 days ahead stamps the event time it sends (the Kafka
        # timestamp stays the broker-accepted one)
        self.run.poison[marker] = "further ahead of the clock"
        ahead = str(int(time.time() * 1000) + 72 * HOUR).encode()
        return Send(body, partition, [("onceflow-ts", ahead)], ts)

    def attempt(self, kill_after: float | None, echo: Any = None) -> Outcome:
        """Run once with the background faults (:mod:`.faults`: a broker restart, a Redis
        Cluster failover, ``extra_faults``) beside it; see :meth:`_attempt`."""
        faults = background_faults(self.run.workdir, self.rng, self.broker, self.redis_cluster)
        if self.extra_faults is not None:
            faults += self.extra_faults(self)
        for fault in faults:
            fault.start()
        try:
            return self._attempt(kill_after, echo)
        finally:
            for fault in faults:
                fault.finish()
            self.background += faults
            if self.on_attempt is not None:
                self.on_attempt(self)

    def faults_made(self, kind: str) -> int:
        """Background faults of ``kind`` made and repaired so far."""
        return sum(f.happened for f in self.background if f.kind == kind)

    def _attempt(self, kill_after: float | None, echo: Any = None) -> Outcome:
        """Run once; ``kill_after``: kill -9 that long after its first new micro-batch began.

        Counting from the first new batch, not from the start (~8 s of JVM and query start),
        puts the kills among the batches' commits rather than before them or after the run
        ended. Every other attempt after a kill counts from its start instead, to about when
        the batch the kill cut short is being replayed: a kill during recovery.
        """
        timer = None
        if kill_after is not None:
            during_replay = self.kills % 2 == 1 and self.startup_s is not None
            timer = KillTimer(self.run, kill_after)
            if during_replay:
                assert self.startup_s is not None
                timer.from_start = self.startup_s - 0.5 + kill_after / 2
        when: Any = timer
        crashes = None
        if self.redis_host is not None and (kill_after is not None or self.crash_always):
            first_s = kill_after if kill_after is not None else self.rng.uniform(0.5, 2.0)
            crashes = RedisHostCrashes(self.run, self.redis_host, self.rng, first_s)
            when = crashes.then(timer)
        outcome = run_pipeline(
            self.pipeline, self.run.args(), env=self.run.env, kill_when=when, echo=echo
        )
        if crashes is not None:
            self.redis_crashes += crashes.done
        self.reruns += outcome.output.count("running it again")
        self.stops += own_stops(outcome.output)
        self.outcomes.append(outcome)
        if timer is not None and timer.began is not None and self.startup_s is None:
            self.startup_s = timer.began - timer.created  # the first attempt: nothing to replay
        if outcome.crashed:
            self.kills += 1
            self.in_flight += bool(timer and timer.in_flight)
        else:
            outcome.check()
        return outcome


@dataclass
class RedisHostCrashes:
    """Crash Redis's host during one attempt (``kill_when`` asks it, it never kills the run).

    Two crashes: the first ``first_s`` after the attempt's first new micro-batch began, the
    next a second or two later; then it asks ``after`` (the attempt's kill timer, counting
    from the last crash) whether to kill the pipeline too.
    """

    run: Run
    redis: CrashableRedis
    rng: random.Random
    first_s: float
    crashes: int = 2
    done: int = 0
    began: float | None = None
    last: float | None = None
    after: Any = None
    _planned_before: int | None = None

    def then(self, after: Any) -> RedisHostCrashes:
        """Ask ``after`` once the crashes are done."""
        self.after = after
        return self

    def __call__(self) -> bool:
        planned = highest_batch(self.run.workdir, "offsets")
        if self._planned_before is None:
            self._planned_before = planned
        now = time.monotonic()
        if self.began is None and planned > self._planned_before:
            self.began = now
        if self.began is not None and self.done < self.crashes:
            due = self.first_s if self.last is None else self.rng.uniform(1.0, 2.5)
            if now - (self.last or self.began) > due:
                self.redis.crash_host(self.rng)
                self.done += 1
                self.last = time.monotonic()
            return False
        return bool(self.after is not None and self.done >= self.crashes and self.after())


IN_FLIGHT_WAIT_S = 30.0  # how long a kill due between micro-batches waits for the next one


@dataclass
class KillTimer:
    """When to kill one attempt (``run_pipeline(kill_when=...)``), and what the kill cut short.

    ``seconds`` after the first micro-batch the checkpoint had not planned before, or, if
    ``from_start`` is set, that many seconds after the attempt began. A kill due between two
    micro-batches waits up to :data:`IN_FLIGHT_WAIT_S` for the next one to be planned, so
    that it cuts a batch short (the case the torture is about) however fast the machine runs
    the batches; past that wait it kills anyway.
    """

    run: Run
    seconds: float
    from_start: float | None = None
    created: float = field(default_factory=time.monotonic)
    began: float | None = None
    in_flight: bool = False  # a planned batch was not committed when the kill came
    _planned_before: int | None = None
    _due_at: float | None = None

    def __call__(self) -> bool:
        planned = highest_batch(self.run.workdir, "offsets")
        if self._planned_before is None:
            self._planned_before = planned
        now = time.monotonic()
        if self.began is None and planned > self._planned_before:
            self.began = now
        if self.from_start is not None:
            due = now - self.created > self.from_start
        else:
            due = self.began is not None and now - self.began > self.seconds
        if not due:
            return False
        self.in_flight = planned > highest_batch(self.run.workdir, "commits")
        if self._due_at is None:
            self._due_at = now
        return self.in_flight or now - self._due_at > IN_FLIGHT_WAIT_S


def own_stops(output: str) -> list[str]:
    """The run's own error lines (``error: pipeline ... stopped/failed``): a run that stopped
    by itself, before the torture's kill, instead of riding the fault out."""
    return [line for line in output.splitlines() if line.startswith("error: pipeline")]


DOC_BYTES = 1_000_000  # the largest document: a record of ~1 MB, under the 1 MiB limit
# bytes per atomic commit with documents: a record's outputs must fit one (4 MiB by default,
# less than five sinks' copies of a 1 MB document, which would be a dead letter saying so)
DOCS_CHUNK_BYTES = 16 << 20


def document(rng: random.Random) -> str:
    """A document body of 0.5 to 1 MB (JSON text); one in four is the largest, 1 MB."""
    size = DOC_BYTES if rng.random() < 0.25 else rng.randrange(500_000, DOC_BYTES)
    return (f"{rng.randrange(10**8):08d}" * (size // 8 + 1))[:size]


def torture(
    bootstrap: str,
    redis_url: str,
    workdir: str,
    *,
    seed: int,
    kills: int,
    wave: int,
    min_kill_s: float = 0.0,
    max_kill_s: float = 3.0,
    cap: int | None = None,
    echo: Any = None,
    client: str = "python",
    ids: str = "mixed",
    redis_host: CrashableRedis | None = None,
    sinks_env: dict[str, str] | None = None,
    process: bool = False,
    docs: float = 0.0,
    broker: LocalKafka | None = None,
    redis_cluster: LocalRedisCluster | None = None,
    replay: bool = False,
    on_attempt: Any = None,
    crash_always: bool = False,
) -> Torture:
    """Waves of input and ``kills`` random kills, then a final run to the end; not checked.

    ``client`` is the Kafka client of the pipeline's source and sinks (``TOTALS_CLIENT``).
    ``ids``: ``mixed`` (byte and text headers and the body's field, by event) or ``positions``
    (none: offsets are the IDs).

    ``sinks_env`` adds sinks to the pipeline (``TOTALS_PARQUET``, ``TOTALS_JSONL``,
    ``TOTALS_ICEBERG``, ``TOTALS_PG_TABLE``: see ``tests/e2e_pipelines/totals.py`` and
    ``real_input.sinks_env``); :func:`check` reads them back.

    ``broker`` (the one ``bootstrap`` names) is killed -9 and started again in every attempt,
    ``redis_cluster`` (the one ``redis_url`` names) has a master failed over in every attempt
    (:mod:`.faults`). ``replay``: once every dead letter is written, their causes are fixed and
    they are replayed beside a killed attempt, then a last run (:mod:`.replays`).
    ``on_attempt`` is called with the torture after each attempt. ``crash_always``: Redis's
    host crashes in the attempts that must run to their end too (each must still end by
    itself, exit status 0), not only in the killed ones.

    ``process`` adds the process stage ``per-user`` (state and
    timers) and events it rejects; ``docs`` is the share of events carrying a document of
    0.5-1 MB (through the map, the sinks and, with ``process``, the stage's state).

    ``cap`` (records per micro-batch, a third of a wave by default): smaller makes each run
    last longer, so a kill lands mid-run more often. A kill lands between ``min_kill_s`` and
    ``max_kill_s`` after the attempt's first new micro-batch began.
    """
    if ids not in ("mixed", "positions"):
        raise ValueError(f"ids must be mixed or positions, got {ids!r}")
    if process and ids == "positions":  # a re-sent rejected event would be a second letter
        raise ValueError("process needs ids='mixed'")
    rng = random.Random(seed)
    name = f"torture-{seed}-{uuid.uuid4().hex[:6]}"
    # several commits per task, so that a kill often lands between two of them
    env = {"TOTALS_CHUNK_SIZE": str(CHUNK), "TOTALS_SLOW_MS": str(SLOW_MS)}
    if ids == "mixed":
        env["TOTALS_ID_FIELD"] = "if-present"
    if process:
        env["TOTALS_PER_USER"] = f"{name}-per-user"
    if docs:  # a document goes to up to five sinks: 5 MB of outputs for one record of 1 MB
        env["TOTALS_CHUNK_BYTES"] = str(DOCS_CHUNK_BYTES)
    run = Run(
        name,
        bootstrap,
        redis_url,
        workdir,
        PARTITIONS,
        extra_env={"TOTALS_CLIENT": client, **env, **(sinks_env or {})},
        cap=cap or wave // 3,
    )
    base_ts = (int(time.time() * 1000) // HOUR - 4) * HOUR
    t = Torture(run, seed, rng, base_ts, positions=ids == "positions", redis_host=redis_host)
    t.rejects, t.docs = process, docs
    t.broker, t.redis_cluster, t.on_attempt = broker, redis_cluster, on_attempt
    t.crash_always = crash_always
    t.wave(wave)
    for _ in range(kills):
        t.attempt(rng.uniform(min_kill_s, max_kill_s), echo)
        t.wave(wave // 2)
    t.attempt(None, echo)
    if replay:  # every letter is written now: fix, replay beside a killed attempt, run
        t.wave(wave // 2, poison=False)
        t.replays = replay_dead_letters(t, rng.uniform(min_kill_s, max_kill_s), echo)
        t.attempt(None, echo)
    return t


def check(t: Torture, client: Any, connect: Any = None) -> dict[str, int]:
    """The independent check; returns facts for a report (``connect``: scopes' clients)."""
    facts = verify(t.run, client, connect)
    facts.update(
        kills=t.kills,
        kills_mid_batch=t.in_flight,
        events=t.run.events.total(),
        poison=len(t.run.poison),
        duplicates_dropped=stats(client, t.run).get("duplicates", 0),
        redis_crashes=t.redis_crashes,
        redis_lost_bytes=t.redis_host.lost_bytes() if t.redis_host is not None else 0,
        batches_run_again=t.reruns,
        broker_restarts=t.faults_made(BrokerRestart.kind),
        redis_failovers=t.faults_made(ClusterFailover.kind),
        documents=len(t.run.sizes),
        **replay_facts(t.replays),
    )
    if "TOTALS_PER_USER" in t.run.extra_env:
        facts.update(check_per_user(t))
    return facts


def check_per_user(t: Torture) -> dict[str, int]:
    """The process stage's output against the events it had to count, read independently.

    Each counted event one output (one value per output ID), none for a rejected one; a user's
    ``seen`` values exactly 1..n (a state change lost, repeated or left by a failing call
    breaks the run of numbers); the last one's kept document the greatest of the user's.
    """
    topic = t.run.extra_env["TOTALS_PER_USER"]
    by_id: dict[bytes, set[bytes]] = defaultdict(set)
    raw = 0
    for rec in read_topic(KafkaSettings(t.run.bootstrap), topic):
        by_id[rec.headers["onceflow-id"]].add(rec.value or b"")
        raw += 1
    assert all(len(v) == 1 for v in by_id.values()), "a per-user ID was written with two values"
    assert raw == len(by_id), f"per-user topic: {raw - len(by_id)} records read twice"
    outs = [json.loads(next(iter(v))) for v in by_id.values()]
    want = Counter(eid for events in t.per_user.values() for eid, _ in events)
    report = compare_counts(want, Counter(o["event_id"] for o in outs))
    assert report.ok, f"per-user outputs: {report}"
    by_user: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for o in outs:
        by_user[o["user"]].append(o)
    for user, events in t.per_user.items():
        seen = sorted(o["seen"] for o in by_user[user])
        assert seen == list(range(1, len(events) + 1)), f"{user}'s counts: {seen}"
        last = next(o for o in by_user[user] if o["seen"] == len(events))
        docs = [(eid, size) for eid, size in events if size]
        best = max(docs) if docs else (None, 0)
        assert (last["best"], last["best_len"]) == best, f"{user}'s document: {last}, {best}"
    documents = sum(1 for events in t.per_user.values() for _, size in events if size)
    return {"per_user_outputs": raw, "documents": documents}


def main(argv: list[str] | None = None) -> int:
    """``--minutes``: keep doing seeded torture rounds for that long, each checked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kills", type=int, default=4, help="kills per round")
    parser.add_argument("--wave", type=int, default=3000, help="events in the first wave")
    parser.add_argument("--ids", choices=("mixed", "positions"), default="mixed")
    parser.add_argument(
        "--redis-host-crash",
        action="store_true",
        help="crash Redis's host too, twice per attempt (a Redis 8 with everysec it starts)",
    )
    parser.add_argument(
        "--process", action="store_true", help="a process stage that rejects some events"
    )
    parser.add_argument(
        "--docs", type=float, default=0.0, help="share of events with a 0.5-1 MB document"
    )
    parser.add_argument("--cap", type=int, default=None, help="records per micro-batch")
    parser.add_argument(
        "--broker-restart", action="store_true", help="kill -9 and restart the broker too"
    )
    parser.add_argument(
        "--sinks", default="", help=f"more sinks, read back: some of {','.join(SINKS)}"
    )
    parser.add_argument(
        "--replay", action="store_true", help="then fix and replay the dead letters, killed"
    )
    args = parser.parse_args(argv)
    import redis

    from onceflow.testing.postgres import PASSWORD, LocalPostgres
    from onceflow.testing.services import LocalRedis, modern_redis_binary

    sinks = tuple(s for s in args.sinks.split(",") if s)

    deadline = time.monotonic() + args.minutes * 60
    with contextlib.ExitStack() as stack:
        host = None
        if args.redis_host_crash:
            host = stack.enter_context(CrashableRedis(binary=modern_redis_binary()))
        redis_url = (host.url if host else None) or os.environ.get("REDIS_URL")
        redis_url = redis_url or stack.enter_context(LocalRedis()).url
        kafka = None
        if args.broker_restart or not os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
            kafka = stack.enter_context(LocalKafka())
        bootstrap = kafka.bootstrap if kafka else os.environ["KAFKA_BOOTSTRAP_SERVERS"]
        postgres = None
        if "postgres" in sinks:
            server = LocalPostgres().start()
            stack.callback(server.stop)
            postgres = {"PG_CONNINFO": server.conninfo, "PGPASSWORD": PASSWORD}
        client = redis.Redis.from_url(redis_url)
        seed = args.seed
        while time.monotonic() < deadline:
            workdir = tempfile.mkdtemp(prefix=f"onceflow-torture-{seed}-")
            t = torture(
                bootstrap,
                redis_url,
                workdir,
                seed=seed,
                kills=args.kills,
                wave=args.wave,
                ids=args.ids,
                redis_host=host,
                process=args.process,
                docs=args.docs,
                cap=args.cap,
                broker=kafka if args.broker_restart else None,
                sinks_env=sinks_env(workdir, sinks, postgres),
                replay=args.replay,
            )
            try:
                facts = check(t, client)
                assert not t.stops, f"a run stopped by itself on a fault: {t.stops}"
            except AssertionError as exc:
                print(f"seed {seed}: FAILED after {t.kills} kills: {exc}", flush=True)
                return 1
            print(f"seed {seed}: exact ({facts})", flush=True)
            seed += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""User state and timers end to end: Kafka in, sessions out, killed mid-run, against a
plain-Python reference.

``tests/e2e_pipelines/user_sessions.py`` cuts each user's events into sessions with a bag,
a map, a combining state and an event-time timer (``Stream.process``). Events go in out of
order (within the watermark's out-of-orderness), some twice, then one far-ahead event per
partition so that every session's timer fires. The run is killed (SIGKILL of every
process) at a chosen point and run again. The output topic is then read as a
``read_committed`` consumer outside Onceflow would, and compared with sessions computed from
the events alone: every session once, with the reference's total and event count; each
event's output once, with the random token its session was emitted with (the function draws
it: a replay must restore what was committed, not run it again); each
user's session indexes run from 0 without gaps (the combining state was neither lost nor
advanced twice); no record ID twice; no event seen twice by the state (the map's check).
"""

from __future__ import annotations

import json
import os
import random
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

import pytest

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce, read_topic
from onceflow.kernel.ids import ID_HEADER
from onceflow.operations.status import status
from onceflow.testing.harness import Crash, crash_and_resume
from tests.exactly_once.scenario import BASE_TS

PIPELINE = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "e2e_pipelines", "user_sessions.py"
)
OUT_OF_ORDER_MS = 10_000
JITTER_MS = 3_000  # arrival disorder: twice this stays within the out-of-orderness
GAP_MS = 20_000
USERS = 100
EVENTS = 800
STEP_MS = 400
FLUSH_USER = "zz-flush"

CRASHES = {
    # a batch's timers fire in its end-of-task step: killed just before it commits
    "killed-before-timers-commit": Crash("before_finish", stage="sessions", batch=3),
    "killed-after-timers-commit": Crash("after_finish", stage="sessions", batch=4),
    "killed-after-chunk-commit": Crash("after_commit", stage="sessions", batch=2),
}
IN_CI = "killed-before-timers-commit"


@dataclass
class SessionRun:
    name: str
    bootstrap: str
    redis_url: str
    workdir: str
    accepted: list = field(default_factory=list)

    @property
    def env(self):
        return {
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "US_PIPELINE": self.name,
            "US_IN": f"{self.name}-in",
            "US_OUT": f"{self.name}-out",
            "US_GAP_MS": str(GAP_MS),
            "US_OUT_OF_ORDER": f"{OUT_OF_ORDER_MS}ms",
        }

    @property
    def args(self):
        return [
            "--available-now",
            "--max-records-per-batch",
            "200",
            "--redis-url",
            self.redis_url,
            "--checkpoint",
            os.path.join(self.workdir, "checkpoint"),
            "--output-dir",
            os.path.join(self.workdir, "out"),
            "--master",
            "local[2,4]",
        ]

    def send(self, sends):
        produce(
            KafkaSettings(self.bootstrap),
            self.env["US_IN"],
            [(None, json.dumps(e).encode(), None) for e, _ in sends],
            partitions=2,
            partitioner=lambda n, _key: sends[n][1],
        )


def _event(rng, ts, user=None):
    return {
        "event_id": str(uuid.uuid4()),
        "user": user or f"u{rng.randrange(USERS):03d}",
        "ts": ts,
        "v": rng.randrange(1, 10),
    }


def _events(run, rng):
    """Events out of order, some sent twice, then a far-ahead one per partition."""
    events = [
        _event(rng, BASE_TS + i * STEP_MS + rng.randrange(-JITTER_MS, JITTER_MS))
        for i in range(EVENTS)
    ]
    sends = [(e, i % 2) for i, e in enumerate(events)]
    for e in rng.sample(events[: EVENTS - 20], 50):  # sent again a little later, anywhere
        sends.insert(events.index(e) + rng.randrange(1, 20), (e, rng.randrange(2)))
    top = max(e["ts"] for e in events)
    sends += [(_event(rng, top + 600_000, FLUSH_USER), p) for p in (0, 1)]
    run.accepted += events
    run.send(sends)


def reference(events):
    """Per user: its sessions in time order, ``(start, end, total, events)``."""
    by_user = defaultdict(list)
    for e in events:
        by_user[e["user"]].append((e["ts"], e["v"]))
    out = {}
    for user, items in by_user.items():
        sessions: list[list[int]] = []
        for ts, v in sorted(items):
            if sessions and ts < sessions[-1][1]:
                sessions[-1][1] = max(sessions[-1][1], ts + GAP_MS)
                sessions[-1][2] += v
                sessions[-1][3] += 1
            else:
                sessions.append([ts, ts + GAP_MS, v, 1])
        out[user] = [tuple(s) for s in sessions]
    return out


@pytest.mark.crash
@pytest.mark.kafka
@pytest.mark.parametrize(
    "crash_name",
    [n if n == IN_CI else pytest.param(n, marks=pytest.mark.long) for n in sorted(CRASHES)],
)
def test_sessions_by_timer_once_with_the_reference_value(
    crash_name, broker, redis_server, tmp_path
):
    rng = random.Random(crash_name)
    run = SessionRun(
        f"us-{uuid.uuid4().hex[:8]}", broker.bootstrap, redis_server.url, str(tmp_path)
    )
    _events(run, rng)
    first, _second = crash_and_resume(
        PIPELINE, CRASHES[crash_name], run.args, env=run.env, timeout=300
    )
    assert first.crashed, first.output[-2000:]

    records = list(read_topic(KafkaSettings(run.bootstrap), run.env["US_OUT"]))
    ids = [r.headers[ID_HEADER] for r in records]
    assert len(ids) == len(set(ids)), "a record was written twice"
    values = [json.loads(r.value) for r in records]
    assert not [v for v in values if "twice" in v], "the state saw an event twice"
    token_of = {v["event"]: v["token"] for v in values if "event" in v}
    assert len(token_of) == len([v for v in values if "event" in v]), "an event left twice"
    assert set(token_of) == {e["event_id"] for e in run.accepted} | {
        v["event"] for v in values if v.get("user") == FLUSH_USER
    }
    got = defaultdict(list)
    for v in values:
        if "start" in v:
            got[v["user"]].append(v)
            # the random token the state held is the one its events left with
            assert {token_of[i] for i in v["ids"]} == {v["token"]}, v
    expected = reference(run.accepted)
    wrong = []
    for user, sessions in expected.items():
        mine = sorted(got.get(user, []), key=lambda s: s["index"])
        if [s["index"] for s in mine] != list(range(len(mine))):
            wrong.append((user, "indexes", [s["index"] for s in mine]))
        seen = [(s["start"], s["end"], s["total"], s["events"]) for s in mine]
        if seen != sessions:
            wrong.append((user, sessions, seen))
    assert not wrong, f"{len(wrong)} of {len(expected)} users wrong, e.g. {wrong[:2]}"
    assert set(got) == set(expected)
    assert sum(len(s) for s in expected.values()) > 2 * USERS  # gaps cut sessions

    # each user keeps its session count (its bag was cleared by its last firing); only the
    # flush user's timer is left, which the watermark never reaches (onceflow status)
    row = status(redis_server.client(), run.name).state["sessions"]
    assert (row.get("keys"), row.get("open_windows")) == (len(expected) + 1, 1), row

    dead = read_topic(KafkaSettings(run.bootstrap), f"{run.name}.dead-letters")
    letters = [json.loads(d.value) for d in dead]
    assert not letters, f"unexpected dead letters: {letters[:3]}"

"""Windows end to end: Kafka in, panes out, killed mid-run, against a plain-Python reference.

Each case feeds ``tests/e2e_pipelines/windows.py`` (per-user sums over event-time windows)
in three phases, each a separate run that resumes from the last:

1. events out of order (within the watermark's out-of-orderness), some sent twice; the run
   is killed (SIGKILL of every process) at a chosen point and run again;
2. late events: some within the allowed lateness (they must count), some for windows long
   closed (they must land in dead letters with the reason, and nowhere else);
3. one far-ahead event per partition, so the watermark passes every window: all must close.

The panes topic is then read as a ``read_committed`` consumer outside Onceflow would, and
compared with the reference computed from the events alone: every closed window has exactly
one final pane, with the reference's value; pane indexes run from 0 without gaps; no record
ID appears twice.
"""

from __future__ import annotations

import json
import os
import random
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.sink import PANE_HEADER, WINDOW_HEADER
from onceflow.connectors.kafka.topics import produce, read_topic
from onceflow.kernel.ids import ID_HEADER
from onceflow.kernel.windows import Fixed, Sessions, Sliding
from onceflow.testing.harness import Crash, crash_and_resume, run_pipeline
from tests.exactly_once.scenario import BASE_TS

PIPELINE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e_pipelines", "windows.py")
OUT_OF_ORDER_MS = 30_000
JITTER_MS = 10_000  # arrival disorder: twice this stays within the out-of-orderness
EVENTS = 1500
STEP_MS = 400
FLUSH_USER = "zz-flush"


@dataclass
class Case:
    kind: str  # WIN_KIND
    lateness_ms: int = 0
    env: dict = field(default_factory=dict)
    crash: Crash | None = None

    def window_fn(self):
        kind, *params = self.kind.split(":")
        return {"fixed": Fixed, "sliding": Sliding, "sessions": Sessions}[kind](*params)


CASES = {
    "fixed-lateness-killed-after-finish": Case(
        "fixed:60s", 120_000, crash=Crash("after_finish", stage="total", batch=1)
    ),
    "sliding-early-killed-before-finish": Case(
        "sliding:2m:1m",
        0,
        {"WIN_EARLY_EVERY": "40"},
        Crash("before_finish", stage="total", batch=1),
    ),
    "sessions-discarding-killed-mid-merge": Case(
        "sessions:5s",
        0,
        {"WIN_ACCUMULATION": "discarding", "WIN_EARLY_EVERY": "10"},
        Crash("after_commit", stage="total", batch=2),
    ),
}


@dataclass
class WindowRun:
    """One case's topics, pipeline name and what was sent."""

    name: str
    bootstrap: str
    redis_url: str
    workdir: str
    case: Case
    accepted: list = field(default_factory=list)  # events that must count
    too_late: list = field(default_factory=list)  # events that must be dead letters
    newest: dict = field(default_factory=dict)  # partition -> largest event time sent

    @property
    def env(self):
        return {
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "WIN_PIPELINE": self.name,
            "WIN_IN": f"{self.name}-in",
            "WIN_OUT": f"{self.name}-out",
            "WIN_KIND": self.case.kind,
            "WIN_LATENESS": f"{self.case.lateness_ms}ms" if self.case.lateness_ms else "0",
            "WIN_OUT_OF_ORDER": f"{OUT_OF_ORDER_MS}ms",
            **self.case.env,
        }

    @property
    def args(self):
        return [
            "--available-now",
            "--max-records-per-batch",
            "400",
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
        for e, p in sends:
            self.newest[p] = max(self.newest.get(p, e["ts"]), e["ts"])
        produce(
            KafkaSettings(self.bootstrap),
            self.env["WIN_IN"],
            [(None, json.dumps(e).encode(), None) for e, _ in sends],
            partitions=2,
            partitioner=lambda n, _key: sends[n][1],
        )

    def run(self, crash=None):
        if crash is None:
            return run_pipeline(PIPELINE, self.args, env=self.env, timeout=300).check()
        first, second = crash_and_resume(PIPELINE, crash, self.args, env=self.env, timeout=300)
        assert first.crashed, first.output[-2000:]
        return second

    @property
    def watermark(self):
        """What the pipeline's watermark is once everything sent so far is committed."""
        return min(self.newest.values()) - OUT_OF_ORDER_MS


def _event(rng, ts, user=None):
    return {
        "event_id": str(uuid.uuid4()),
        "user": user or f"u{rng.randrange(6)}",
        "ts": ts,
        "v": rng.randrange(1, 10),
    }


def _phase_one(run, rng):
    events = [
        _event(rng, BASE_TS + i * STEP_MS + rng.randrange(-JITTER_MS, JITTER_MS))
        for i in range(EVENTS)
    ]
    sends = [(e, i % 2) for i, e in enumerate(events)]
    for e in rng.sample(events[: EVENTS - 20], 60):  # sent again a little later, anywhere
        sends.insert(events.index(e) + rng.randrange(1, 20), (e, rng.randrange(2)))
    run.accepted += events
    run.send(sends)


def _phase_two(run, rng):
    """Late events: within the allowed lateness (they count), beyond it (dead letters)."""
    wm = run.watermark
    fn = run.case.window_fn()
    sends = []
    for _ in range(5):
        e = _event(rng, BASE_TS + rng.randrange(0, 60_000))  # windows long closed
        run.too_late.append(e)
        sends.append((e, rng.randrange(2)))
    if run.case.lateness_ms:
        last_end = max(e for _, e in fn.assign(wm)) - fn.size_ms  # the newest window passed
        for _ in range(5):  # past its window's end, within the lateness
            ts = last_end - 1 - rng.randrange(0, fn.size_ms // 2)
            end = max(e for _, e in fn.assign(ts))
            assert end <= wm < end + run.case.lateness_ms
            e = _event(rng, ts)
            run.accepted.append(e)
            sends.append((e, rng.randrange(2)))
    run.send(sends)


def _phase_three(run):
    top = max(run.newest.values())
    run.send([({**_event(random.Random(0), top + 600_000, FLUSH_USER)}, p) for p in (0, 1)])


def reference(fn, events):
    """Per (user, start, end): the sum of ``v`` of the events in that window."""
    out: Counter = Counter()
    if not fn.merging:
        for e in events:
            for start, end in fn.assign(e["ts"]):
                out[(e["user"], start, end)] += e["v"]
        return out
    by_user = defaultdict(list)
    for e in events:
        by_user[e["user"]].append((e["ts"], e["v"]))
    for user, items in by_user.items():
        items.sort()
        start, end, total = items[0][0], items[0][0] + fn.gap_ms, 0
        for ts, v in items:
            if ts >= end:
                out[(user, start, end)] = total
                start, end, total = ts, ts + fn.gap_ms, 0
            end = max(end, ts + fn.gap_ms)
            total += v
        out[(user, start, end)] = total
    return out


def read_panes(run):
    """Panes per window, as a consumer outside Onceflow sees them, and every record ID."""
    panes = defaultdict(list)
    ids = []
    for rec in read_topic(KafkaSettings(run.bootstrap), run.env["WIN_OUT"]):
        start, end = (int(x) for x in rec.headers[WINDOW_HEADER].decode().split(","))
        timing, index, final = rec.headers[PANE_HEADER].decode().split(",")
        panes[(rec.key.decode(), start, end)].append(
            (int(index), timing, final == "1", json.loads(rec.value))
        )
        ids.append(rec.headers[ID_HEADER])
    return panes, ids


# In the default suite: the session merge killed midway (merges, early panes and discarding
# panes at once); the other two cases run with --long.
IN_CI = "sessions-discarding-killed-mid-merge"


@pytest.mark.crash
@pytest.mark.kafka
@pytest.mark.parametrize(
    "case_name",
    [n if n == IN_CI else pytest.param(n, marks=pytest.mark.long) for n in sorted(CASES)],
)
def test_windows_close_once_with_the_reference_value(case_name, broker, redis_server, tmp_path):
    case = CASES[case_name]
    rng = random.Random(case_name)
    run = WindowRun(
        f"win-{uuid.uuid4().hex[:8]}", broker.bootstrap, redis_server.url, str(tmp_path), case
    )
    _phase_one(run, rng)
    run.run(case.crash)
    _phase_two(run, rng)
    run.run()
    _phase_three(run)
    run.run()

    panes, ids = read_panes(run)
    assert len(ids) == len(set(ids)), "a pane was written twice"
    expected = reference(case.window_fn(), run.accepted)
    closed = {w for w in expected if w[2] + case.lateness_ms <= run.watermark}
    assert closed == set(expected), "the flush must close every window"
    real = {w: p for w, p in panes.items() if w[0] != FLUSH_USER}
    discarding = case.env.get("WIN_ACCUMULATION") == "discarding"
    wrong = []
    for window, total in expected.items():
        fired = sorted(real.get(window, []))
        finals = [p for p in fired if p[2]]
        value = total if discarding else (finals[0][3] if finals else None)
        if len(finals) != 1 or value != total or [p[0] for p in fired] != list(range(len(fired))):
            wrong.append((window, total, fired))
    assert not wrong, f"{len(wrong)} of {len(expected)} windows wrong, e.g. {wrong[:3]}"
    if discarding:  # each record leaves in one pane per window it is in (sessions: the window
        # it was in when that pane fired, which may later have merged into a larger one)
        emitted, wanted = Counter(), Counter()
        for (user, _s, _e), fired in real.items():
            emitted[user] += sum(p[3] for p in fired)
        for (user, _s, _e), total in expected.items():
            wanted[user] += total
        assert emitted == wanted
    leftover = [w for w in real if w not in expected and any(p[2] for p in real[w])]
    assert not leftover, f"final panes of windows the reference has not: {leftover[:3]}"

    dead = read_topic(KafkaSettings(run.bootstrap), f"{run.name}.dead-letters")
    letters = [json.loads(d.value) for d in dead]
    late = [x for x in letters if x["code"] == "window_closed"]
    assert all("windows that have closed" in x["error"] for x in late)
    assert all(f"{run.env['WIN_IN']}:" in x["origin"] for x in late), "where it was read"
    # a record's ID is its event_id's UUID (the pipeline's id function)
    sent_late = sorted(uuid.UUID(e["event_id"]).hex for e in run.too_late)
    assert sorted(x["id"] for x in late) == sent_late
    assert len(letters) == len(late), f"unexpected dead letters: {letters[:3]}"

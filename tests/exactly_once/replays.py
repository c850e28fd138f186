"""The dead-letter replay (``onceflow dead-letters replay``) under the torture's faults.

Once a torture run's last attempt has written every dead letter, the causes of three kinds
are fixed (``TOTALS_FIXED=1`` in ``tests/e2e_pipelines/totals.py``: undecodable records
read, ``blow_up`` no longer fails ``enrich``; a record with an empty ID header needs no
fix, the replay gives it an ID) and the letters are replayed while the pipeline runs again
with the torture's faults (kill -9, Redis host crashes, a broker restart). The replay is
driven as operators do it, from the command line, and as badly as they can: a first replay is
killed -9 at a random moment (it may have sent some, all or none of its letters, and saved
its progress or not; one that ended first is followed by one killed sooner), then two
replays run at once (each reads the saved progress before the other saves it: every letter
is sent again, twice); a replay that fails (the broker is down) is run again.

Each replayed letter's event must then count once everywhere (the user's total, the copy
topic, every sink, the process stage); the letters themselves stay in the dead-letter topic,
no new one may appear, and the letters of the other kinds (an event days ahead, events the
process stage rejected after a shuffle) are left.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onceflow.testing.harness import kill_session
from tests.exactly_once.faults import BackgroundFault

if TYPE_CHECKING:
    from tests.exactly_once.torture import Torture

# the poison whose cause TOTALS_FIXED fixes: each becomes an event of u0 for 100 once replayed
REPLAYABLE = ("cannot decode as json", "header is empty", "asked to blow up")
REPLAYED_AMOUNT = 100
TRIES = 6  # a replay that fails (Kafka away) is run again, up to this many times
TIMEOUT_S = 240.0
MIN_KILL_S = 0.1  # a replay's process is still importing Python this soon after its start
_SENT = re.compile(r"(\d+) letter\(s\) to replay")


@dataclass
class ReplayRun:
    """One ``onceflow dead-letters replay`` process and how it ended."""

    returncode: int | None
    killed: bool
    output: str
    sends: int | None  # letters it found to send (None: it said nothing of it)


def replay_once(t: Torture, kill_after: float | None = None) -> ReplayRun:
    """Run the replay command on the torture's pipeline; kill -9 it after ``kill_after`` s."""
    run = t.run
    cmd = [sys.executable, "-m", "onceflow", "dead-letters", "replay", t.pipeline]
    cmd += ["--redis-url", run.redis_url]
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, **run.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    killed = False
    try:
        out, _ = proc.communicate(timeout=kill_after if kill_after is not None else TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        killed = kill_after is not None
        out, _ = proc.communicate(timeout=30)
        if not killed:
            msg = f"a dead-letter replay did not end within {TIMEOUT_S:.0f} s:\n{out[-3000:]!r}"
            raise AssertionError(msg) from None
    finally:
        kill_session(proc.pid)
    text = out.decode(errors="replace")
    found = _SENT.search(text)
    return ReplayRun(proc.returncode, killed, text, int(found.group(1)) if found else None)


def replay_until_done(t: Torture) -> ReplayRun:
    """Replay, again after a failure (the broker away, Redis restarting), until one ends 0."""
    for _ in range(TRIES):
        done = replay_once(t)
        if done.returncode == 0:
            return done
        time.sleep(2.0)
    msg = f"the dead-letter replay failed {TRIES} times; the last said:\n{done.output[-3000:]}"
    raise AssertionError(msg)


def killed_replays(t: Torture, kill_after: float) -> list[ReplayRun]:
    """Replays until one is killed -9: a replay that ends before its kill time (a quick
    machine sends two letters in under a second or two) is followed by one killed at half
    that time, down to the import of the command line (seen in CI: one replay, not killed)."""
    runs = [replay_once(t, kill_after)]
    while not runs[-1].killed and kill_after > MIN_KILL_S:
        kill_after = max(kill_after / 2, MIN_KILL_S)
        runs.append(replay_once(t, kill_after))
    return runs


class Replays(BackgroundFault):
    """The replays of one attempt (see the module docstring), made beside it: the first
    killed -9 ``kill_after`` s after it started."""

    kind = "dead-letter replay"

    def __init__(self, t: Torture, after_s: float, kill_after: float) -> None:
        super().__init__(t.run.workdir, after_s)
        self.t, self.kill_after = t, kill_after
        self.runs: list[ReplayRun] = []

    def fault(self) -> None:
        self.runs += killed_replays(self.t, self.kill_after)
        pair: list[ReplayRun] = []
        threads = [
            threading.Thread(target=lambda: pair.append(replay_until_done(self.t)))
            for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TRIES * TIMEOUT_S)
        assert len(pair) == 2, "a concurrent replay failed"
        self.runs += pair


def replay_dead_letters(t: Torture, kill_after: float | None, echo: Any = None) -> Replays:
    """Fix the causes, replay beside one attempt (killed -9 after ``kill_after`` s if given),
    and count each replayable poison record's event once more in the expectation."""
    run = t.run
    if t.positions:
        msg = "the dead-letter replay needs IDs (ids='mixed'): a letter's ID names its replay"
        raise ValueError(msg)
    run.extra_env["TOTALS_FIXED"] = "1"
    replays = Replays(t, t.rng.uniform(0.0, 2.0), t.rng.uniform(0.5, 4.0))
    t.extra_faults = lambda _t: [replays]
    try:
        t.attempt(kill_after, echo)
    finally:
        t.extra_faults = None
    if not replays.happened:  # the attempt ended before its first new batch: replay now
        replays.fault()
    for marker, reason in run.poison.items():
        if reason in REPLAYABLE:
            run.expected["u0"] += REPLAYED_AMOUNT
            run.events[marker] += 1
            t.per_user["u0"].append((marker, 0))
    return replays


def replay_facts(replays: Replays | None) -> dict[str, int]:
    """What the replays did, for a report."""
    if replays is None:
        return {}
    sent = [r.sends for r in replays.runs if r.sends is not None]
    return {
        "replays": len(replays.runs),
        "replays_killed": sum(r.killed for r in replays.runs),
        "letters_replayed": sum(sent),
    }

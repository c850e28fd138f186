"""Testing helpers for pipeline authors: crash a run at a chosen point, resume, compare.

Exactly-once is a claim about failures, so it is tested by failing on purpose. A pipeline file
runs in a child process (``onceflow run``); a *crash point* freezes the run exactly where
asked (before or after a chunk's commit, after a sink write, at the end of a task or of a
micro-batch) and the harness then kills every process of the run with SIGKILL (driver, JVM and
Python workers alike, as a power cut would). Running the same command again resumes from
Spark's checkpoint and Onceflow's Redis state. Compare the outputs with an independent count
of the inputs: nothing lost, nothing duplicated.

Linux only: the processes of a run (the driver, Spark's JVM and its Python workers, which
PySpark's daemon puts in process groups of their own) are found by their session id in
``/proc/<pid>/stat``, so that all of them can be killed at once.

>>> first, second = crash_and_resume("my_pipeline.py", Crash("after_sink_write", batch=1),
...                                  args=["--available-now", "--redis-url", url])
>>> report = compare_counts(expected_per_key, observed_per_key)
>>> assert report.ok, report
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from onceflow.runtime.faults import POINTS


@dataclass(frozen=True)
class Crash:
    """Where to fail: a point, and optionally the stage, micro-batch and partition.

    ``mode="kill"`` freezes the run there and kills all of it (SIGKILL); ``mode="raise"`` makes
    the task fail so that Spark retries it (run with ``--master local[2,4]`` to allow retries);
    ``mode="pause"`` holds the run there for a few seconds while :func:`run_pipeline`'s
    ``fault`` runs (an outside fault at an exact point), then lets it go on.
    ``batch_end`` is the driver after every sink wrote, before Spark commits the batch.
    """

    point: str
    stage: str | None = None
    batch: int | None = None
    partition: int | None = None
    mode: str = "kill"

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            msg = f"unknown crash point {self.point!r}; use one of {', '.join(POINTS)}"
            raise ValueError(msg)
        if self.mode not in ("kill", "raise", "pause"):
            msg = f"crash mode must be 'kill', 'raise' or 'pause', got {self.mode!r}"
            raise ValueError(msg)

    def env(self) -> str:
        """The ``ONCEFLOW_CRASH`` value."""
        parts = [f"point={self.point}", f"mode={self.mode}"]
        for name in ("stage", "batch", "partition"):
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{name}={value}")
        return ",".join(parts)


@dataclass
class Outcome:
    """How a child run ended."""

    returncode: int | None
    crashed: bool
    output: str
    seconds: float
    where: str = ""

    def check(self) -> Outcome:
        """Raise with the run's output if it neither succeeded nor crashed as planned."""
        if not self.crashed and self.returncode != 0:
            msg = f"run failed with status {self.returncode}:\n{self.output[-4000:]}"
            raise AssertionError(msg)
        return self


EXITED_STATES = ("Z", "X")  # /proc/<pid>/stat: zombie, dead


def session_processes(sid: int) -> list[int]:
    """PIDs of every living process in session ``sid`` (driver, JVM, Spark's Python workers).

    A zombie (exited, not yet reaped by whoever inherited it) is not living: it holds no
    memory, file or socket any more. Waiting for its reaping cost ~1.5 s per run here. A
    process whose main thread exited while another thread still runs is living.
    """
    found = []
    for entry in os.listdir("/proc"):
        fields = _stat_fields(f"/proc/{entry}/stat") if entry.isdigit() else None
        # fields after the name: state, ppid, pgrp, session
        if fields is None or int(fields[3]) != sid:
            continue
        if fields[0] not in EXITED_STATES or _threads_left(entry):
            found.append(int(entry))
    return found


def _stat_fields(path: str) -> list[str] | None:
    """The fields of a ``/proc/.../stat`` file after the command's name (None: it is gone)."""
    try:
        with open(path, encoding="utf-8") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def _threads_left(pid: str) -> bool:
    """Whether any thread of ``pid`` has not exited (its main thread has)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    states = (_stat_fields(f"/proc/{pid}/task/{tid}/stat") for tid in tasks)
    return any(fields is not None and fields[0] not in EXITED_STATES for fields in states)


def kill_session(sid: int) -> None:
    """SIGKILL every process of a session until none is left."""
    for _ in range(50):
        pids = session_processes(sid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


@dataclass
class KillAfter:
    """A power cut at a chosen moment of a run, for :func:`run_pipeline`'s ``kill_when``.

    ``delay`` seconds after the ``nth`` output line holding ``marker`` (``"] batch "``: a
    micro-batch ended; ``"first micro-batch starts"``):
    ``run_pipeline(file, args, echo=k.echo, kill_when=k.when)``, ``k.echo`` perhaps called
    from another ``echo``.
    """

    marker: str
    delay: float
    nth: int = 1
    seen: list[float] = field(default_factory=list)

    def echo(self, line: str) -> None:
        """Note when a line holds the marker."""
        if self.marker in line:
            self.seen.append(time.monotonic())

    def when(self) -> bool:
        """Whether the moment has come."""
        n = self.nth
        return len(self.seen) >= n and time.monotonic() > self.seen[n - 1] + self.delay


def run_pipeline(
    pipeline_file: str,
    args: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    crash: Crash | None = None,
    kill_after: float | None = None,
    timeout: float = 600,
    echo: Callable[[str], None] | None = None,
    fault: Callable[[], None] | None = None,
    kill_when: Callable[[], bool] | None = None,
) -> Outcome:
    """``python -m onceflow run FILE ARGS`` in its own session, crashing it if asked.

    ``crash`` freezes the run at a chosen point and kills it there (or, with
    ``mode="pause"``, calls ``fault`` once while the run waits there); ``kill_after`` kills the
    whole run (every process of its session, SIGKILL) after that many seconds, wherever it
    is, if it is still running: a power cut at a random moment. ``kill_when`` does the same
    once it returns True (it is asked every 50 ms, e.g. "a second after batch 3 began").
    ``echo`` receives each output line as it arrives (to show progress).
    """
    marker = os.path.join(tempfile.mkdtemp(prefix="onceflow-crash-"), "crashed")
    full_env = {**os.environ, **(env or {})}
    full_env.pop("ONCEFLOW_CRASH", None)
    if crash is not None:
        full_env["ONCEFLOW_CRASH"] = crash.env()
        full_env["ONCEFLOW_CRASH_FILE"] = marker
    cmd = [sys.executable, "-m", "onceflow", "run", pipeline_file, *args]
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    chunks: list[bytes] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            chunks.append(line)
            if echo is not None:
                echo(line.decode(errors="replace").rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    crashed = False
    faulted = False
    try:
        while proc.poll() is None:
            if crash is not None and crash.mode == "pause" and not faulted:
                if os.path.exists(marker):
                    faulted = True
                    if fault is not None:
                        fault()
            if _kill_now(crash, marker, started, kill_after, kill_when):
                kill_session(proc.pid)
                crashed = True
                break
            if time.monotonic() - started > timeout:
                kill_session(proc.pid)
                output = b"".join(chunks).decode(errors="replace")
                msg = f"run did not finish within {timeout:.0f} s:\n{output[-4000:]}"
                raise AssertionError(msg)
            time.sleep(0.05)
        proc.wait(30)
    finally:
        kill_session(proc.pid)  # nothing of the run may survive it
    reader.join(5)
    where = ""
    if os.path.exists(marker):
        with open(marker, encoding="utf-8") as fh:
            where = fh.read()
    return Outcome(
        proc.returncode,
        crashed,
        b"".join(chunks).decode(errors="replace"),
        time.monotonic() - started,
        where,
    )


def _kill_now(
    crash: Crash | None,
    marker: str,
    started: float,
    kill_after: float | None,
    kill_when: Callable[[], bool] | None,
) -> bool:
    """Whether a run is due for its kill -9 (see :func:`run_pipeline`)."""
    if crash is not None and crash.mode == "kill" and os.path.exists(marker):
        return True
    if kill_after is not None and time.monotonic() - started > kill_after:
        return True
    return kill_when is not None and kill_when()


def crash_and_resume(
    pipeline_file: str,
    crash: Crash,
    args: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
    echo: Callable[[str], None] | None = None,
) -> tuple[Outcome, Outcome]:
    """Run until ``crash`` (which must be reached), then run again to the end."""
    first = run_pipeline(pipeline_file, args, env=env, crash=crash, timeout=timeout, echo=echo)
    if crash.mode == "kill" and not first.crashed:
        msg = f"crash point {crash.env()} was never reached:\n{first.output[-4000:]}"
        raise AssertionError(msg)
    second = run_pipeline(pipeline_file, args, env=env, timeout=timeout, echo=echo).check()
    return first, second


@dataclass
class Report:
    """Observed against expected counts: what was lost and what was duplicated."""

    expected_total: int
    observed_total: int
    lost: dict[Hashable, int] = field(default_factory=dict)
    duplicated: dict[Hashable, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Nothing lost, nothing duplicated."""
        return not self.lost and not self.duplicated

    @property
    def lost_total(self) -> int:
        """Records missing."""
        return sum(self.lost.values())

    @property
    def duplicated_total(self) -> int:
        """Records counted more than once."""
        return sum(self.duplicated.values())

    def __str__(self) -> str:
        return (
            f"expected {self.expected_total}, observed {self.observed_total}, "
            f"lost {self.lost_total} {dict(list(self.lost.items())[:5])}, "
            f"duplicated {self.duplicated_total} {dict(list(self.duplicated.items())[:5])}"
        )


def compare_counts(expected: Mapping[Any, int], observed: Mapping[Any, int]) -> Report:
    """Per key: observed below expected is lost, above is duplicated."""
    report = Report(sum(expected.values()), sum(observed.values()))
    for key in set(expected) | set(observed):
        diff = observed.get(key, 0) - expected.get(key, 0)
        if diff < 0:
            report.lost[key] = -diff
        elif diff > 0:
            report.duplicated[key] = diff
    return report

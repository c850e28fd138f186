"""Fault injection hooks: where a test may make a run fail or freeze on purpose.

The hooks are free unless ``$ONCEFLOW_CRASH`` is set; :mod:`onceflow.testing` sets it (see
``Crash``) and kills the frozen run. ``ONCEFLOW_CRASH="point=after_commit,stage=count,
batch=1,partition=0,mode=raise"``: fields left out match anything, ``attempt`` defaults to 0
so a retried task gets through. ``mode=raise`` fails the task (Spark retries it);
``mode=kill`` writes ``$ONCEFLOW_CRASH_FILE`` and freezes, so that the harness kills the
whole run with SIGKILL at exactly this point; ``mode=pause`` writes it and sleeps
``$ONCEFLOW_CRASH_PAUSE_S`` seconds (default 8), then goes on: the harness makes an outside
fault meanwhile (a Redis master killed mid-batch, say).
"""

from __future__ import annotations

import itertools
import os
import time
from enum import StrEnum

CRASH_ENV = "ONCEFLOW_CRASH"
CRASH_FILE_ENV = "ONCEFLOW_CRASH_FILE"
PAUSE_ENV = "ONCEFLOW_CRASH_PAUSE_S"
_PAUSE_S = "8"


class CrashPoint(StrEnum):
    """Every place a run may be made to fail on purpose, declared once.

    The runtime calls :func:`crashpoint` and :func:`driver_crashpoint` only with these, and
    ``onceflow.testing.Crash`` accepts only these names (a test naming another fails: see
    ``tests/runtime/test_crashpoints.py``).
    """

    BEFORE_COMMIT = "before_commit"
    AFTER_COMMIT = "after_commit"
    #: end-of-task outputs (combine results, window panes) computed, not stored
    BEFORE_FINISH = "before_finish"
    #: ... stored with their state changes (windows closed), not yet sent on
    AFTER_FINISH = "after_finish"
    #: a transactional sink sent records, no marker yet
    IN_SINK_TRANSACTION = "in_sink_transaction"
    AFTER_SINK_WRITE = "after_sink_write"
    AFTER_SINK_COMMIT = "after_sink_commit"
    TASK_END = "task_end"
    #: the driver, after every sink wrote, before Spark commits the batch
    BATCH_END = "batch_end"


DRIVER_POINTS = frozenset({CrashPoint.BATCH_END})
TASK_POINTS = frozenset(CrashPoint) - DRIVER_POINTS
POINTS = tuple(p.value for p in CrashPoint)  # in declaration order, for messages

_FROZEN_SLEEP_S = 3600


def executor_conf() -> dict[str, str]:
    """Session settings that pass this process's crash request on to every executor.

    In local mode tasks inherit the driver's environment; on a cluster an executor's comes
    from its worker, so the request travels as ``spark.executorEnv.*``.
    """
    return {
        f"spark.executorEnv.{name}": os.environ[name]
        for name in (CRASH_ENV, CRASH_FILE_ENV, PAUSE_ENV)
        if os.environ.get(name)
    }


def _wanted() -> dict[str, str] | None:
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return None
    return dict(item.split("=", 1) for item in spec.split(",") if "=" in item)


def crashpoint(point: CrashPoint, stage: str, batch: int, partition: int, attempt: int) -> None:
    """Fail a task here when ``$ONCEFLOW_CRASH`` asks for it."""
    wanted = _wanted()
    if wanted is None:
        return
    actual = {
        "point": point.value,
        "stage": stage,
        "batch": str(batch),
        "partition": str(partition),
        "attempt": str(attempt),
    }
    wanted.setdefault("attempt", "0")
    if any(wanted[k] != v for k, v in actual.items() if k in wanted):
        return
    trigger_crash(wanted.get("mode", "raise"), f"{point} {stage} b{batch} p{partition}")


def driver_crashpoint(point: CrashPoint, batch: int) -> None:
    """Fail the driver here when ``$ONCEFLOW_CRASH`` asks for it (``mode`` defaults to kill)."""
    wanted = _wanted()
    if wanted is None:
        return
    if wanted.get("point") != point or wanted.get("batch", str(batch)) != str(batch):
        return
    trigger_crash(wanted.get("mode", "kill"), f"{point} driver b{batch}")


def trigger_crash(mode: str, where: str) -> None:
    """Fail (``raise``), freeze until killed (``kill``) or pause while a fault is made."""
    path = os.environ.get(CRASH_FILE_ENV)
    if path:
        with open(path, "a") as fh:
            fh.write(f"{where} pid={os.getpid()}\n")
    if mode == "pause":  # the harness makes an outside fault (kills a Redis master ...) now
        time.sleep(float(os.environ.get(PAUSE_ENV, _PAUSE_S)))
        return
    if mode == "kill":
        for _ in itertools.count():
            time.sleep(_FROZEN_SLEEP_S)
    msg = f"injected failure at {where}"
    raise RuntimeError(msg)

"""Faults the tortures make beside a run, from a thread: a broker restart, a Redis Cluster
failover, anything else that takes seconds (``torture.py``, ``nexmark_torture.py``,
``soak.py``).

Each waits for the attempt's first new micro-batch (the checkpoint's ``offsets`` log gains
one), then ``after_s`` more, then makes its fault, unless the attempt ended first. The
attempt's end waits for a fault under way to complete (a broker started again, a cluster
settled), so the next attempt meets a whole service again, as after an operator's repair.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time

from onceflow.testing.kafka import LocalKafka
from onceflow.testing.redis_cluster import LocalRedisCluster

JOIN_S = 300.0  # how long an attempt's end waits for a fault under way


def highest_batch(workdir: str, log: str) -> int:
    """The highest batch number in the checkpoint's ``offsets`` or ``commits`` log (-1: none)."""
    with contextlib.suppress(FileNotFoundError):
        folder = os.path.join(workdir, "checkpoint", log)
        return max((int(n) for n in os.listdir(folder) if n.isdigit()), default=-1)
    return -1


class BackgroundFault:
    """One fault made once during one attempt (see the module docstring)."""

    kind = "fault"

    def __init__(self, workdir: str, after_s: float) -> None:
        self.workdir, self.after_s = workdir, after_s
        self.done = threading.Event()  # the attempt is over
        self.began_at: float | None = None
        self.back_at: float | None = None  # the fault is over, the service whole again
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name=self.kind)

    def start(self) -> BackgroundFault:
        self.thread.start()
        return self

    def _run(self) -> None:
        before = highest_batch(self.workdir, "offsets")
        while not self.done.is_set() and highest_batch(self.workdir, "offsets") <= before:
            time.sleep(0.05)
        if self.done.wait(self.after_s):
            return  # the attempt ended first
        self.began_at = time.monotonic()
        try:
            self.fault()
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self.error = exc
            return
        self.back_at = time.monotonic()

    def fault(self) -> None:
        """The fault itself, from break to repair."""
        raise NotImplementedError

    def finish(self) -> None:
        """The attempt is over: stop waiting; let a fault under way complete; raise its error."""
        self.done.set()
        self.thread.join(JOIN_S)
        if self.thread.is_alive():
            msg = f"{self.kind} did not complete within {JOIN_S:.0f} s"
            raise AssertionError(msg)
        if self.error is not None:
            raise AssertionError(f"{self.kind} failed: {self.error!r}") from self.error

    @property
    def happened(self) -> bool:
        """The fault was made and repaired during its attempt."""
        return self.back_at is not None


class BrokerRestart(BackgroundFault):
    """Kill -9 the broker, start it again ``down_s`` later on the same data (what it
    acknowledged survives)."""

    kind = "broker restart"

    def __init__(
        self, workdir: str, broker: LocalKafka, after_s: float, down_s: float = 6.0
    ) -> None:
        super().__init__(workdir, after_s)
        self.broker, self.down_s = broker, down_s

    @property
    def killed_at(self) -> float | None:
        return self.began_at

    def fault(self) -> None:
        self.broker.kill()
        time.sleep(self.down_s)
        self.broker.start()


class ClusterFailover(BackgroundFault):
    """Kill -9 one master of a Redis Cluster; once its replica took over, start the old one
    again (it comes back as the new master's replica)."""

    kind = "redis cluster failover"

    def __init__(
        self, workdir: str, cluster: LocalRedisCluster, after_s: float, index: int
    ) -> None:
        super().__init__(workdir, after_s)
        self.cluster, self.index = cluster, index
        self.seconds: float | None = None  # from the kill to a promoted replica

    def fault(self) -> None:
        self.cluster.kill_master(self.index)
        self.seconds = self.cluster.wait_failover().seconds
        self.cluster.restart_node()


def background_faults(
    workdir: str,
    rng: random.Random,
    broker: LocalKafka | None = None,
    cluster: LocalRedisCluster | None = None,
) -> list[BackgroundFault]:
    """The faults of one attempt: a broker restart if ``broker``, a failover if ``cluster``."""
    faults: list[BackgroundFault] = []
    if broker is not None:
        faults.append(BrokerRestart(workdir, broker, rng.uniform(0.3, 1.5)))
    if cluster is not None:
        faults.append(ClusterFailover(workdir, cluster, rng.uniform(0.3, 2.5), rng.randrange(3)))
    return faults

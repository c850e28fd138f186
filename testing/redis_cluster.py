"""A real Redis Cluster on loopback, for failover tests.

``LocalRedisCluster`` runs Debian's ``redis-server`` as a Redis Cluster of 3 masters and 3
replicas (AOF on, fsynced as exactly-once needs, see ``onceflow.testing.services``; a short
node timeout so that failover takes seconds). ``kill_master(i)`` is a crash of the master
serving the i-th slot range, ``wait_failover()`` measures the promotion of its replica,
``restart_node()`` brings the crashed node back as a replica. Its addresses, clients and
topology are :mod:`onceflow.testing.redis_topology`'s.

Every node runs in a session of its own and is tracked (:mod:`onceflow.testing.processes`):
``stop()``, or the end of the interpreter, kills each whole.

>>> with LocalRedisCluster() as redis_cluster:
...     client = redis_cluster.client()
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass

from onceflow.kernel.errors import ServiceError
from onceflow.testing.processes import (
    LOOPBACK,
    POLL_INTERVAL_S,
    PORT_ATTEMPTS,
    executable,
    kill_tree,
    running,
    start_in_session,
    tail,
    wait_for,
)
from onceflow.testing.redis_topology import (
    CLUSTER_NODE_TIMEOUT_MS,
    REDIS_MASTERS,
    REPLICAS_PER_MASTER,
    RedisClusterNodes,
    RedisNode,
    RedisProcess,
)
from onceflow.testing.services import free_port

REDIS_START_TIMEOUT_S = 15.0
FAILOVER_TIMEOUT_S = 30.0
CLUSTER_CREATE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Failover:
    """A master's crash and its replica's promotion, as ``wait_failover`` observed them."""

    killed_port: int
    promoted_port: int
    seconds: float
    """From the SIGKILL until every live node agreed on the new master and said ``ok``."""


class LocalRedisCluster(RedisClusterNodes):
    """A Redis Cluster of ``masters`` masters, each with ``replicas`` replicas, on loopback.

    Each node has its own folder under ``directory`` (AOF, ``nodes.conf``, ``redis.log``)
    and an explicit cluster bus port: the default bus port (port + 10000) overflows for a
    free port above 55535. Addresses, clients and topology: :class:`RedisClusterNodes`.
    """

    def __init__(
        self,
        masters: int = REDIS_MASTERS,
        replicas: int = REPLICAS_PER_MASTER,
        *,
        node_timeout_ms: int = CLUSTER_NODE_TIMEOUT_MS,
        directory: str | None = None,
    ) -> None:
        super().__init__(masters, replicas, node_timeout_ms=node_timeout_ms, directory=directory)
        self._last_kill: tuple[RedisNode, float] | None = None
        self.create_seconds: float | None = None
        """Wall time of the last ``start()``: processes up, cluster created, all nodes ok."""

    # -- lifecycle --

    def start(self) -> LocalRedisCluster:
        """Start every node, create the cluster, return once every node says ``ok``."""
        server = executable("redis-server", "apt-get install -y redis-server")
        started = time.monotonic()
        try:
            for node in self._nodes:
                self._start_node(node, server)
            self._create()
            self._wait_settled()
        except BaseException:
            self.stop()
            raise
        self.create_seconds = time.monotonic() - started
        return self

    def _command(self, node: RedisProcess, server: str) -> list[str]:
        args = {
            "port": node.port,
            "cluster-port": node.bus_port,
            "bind": LOOPBACK,
            "dir": node.directory,
            "cluster-enabled": "yes",
            "cluster-config-file": "nodes.conf",
            "cluster-node-timeout": self.node_timeout_ms,
            # Always let a replica take over, however long it was cut off (tests crash on purpose).
            "cluster-replica-validity-factor": 0,
            # A replica's full sync starts at once instead of waiting 5 s for more replicas.
            "repl-diskless-sync-delay": 0,
            "appendonly": "yes",
            "appendfsync": "always",
            "save": "",
            "protected-mode": "no",
            "daemonize": "no",
            "loglevel": "notice",
        }
        return [server, *(item for k, v in args.items() for item in (f"--{k}", str(v)))]

    def _start_node(self, node: RedisProcess, server: str, fresh_ports: bool = True) -> None:
        """Start one node and wait until it answers; a taken port means fresh ports (if allowed)."""
        node.directory.mkdir(parents=True, exist_ok=True)
        for _attempt in range(PORT_ATTEMPTS):
            node.proc = start_in_session(self._command(node, server), node.log_path)
            if self._answers(node):
                return
            if node.proc.poll() is None or not fresh_ports:
                break
            node.port, node.bus_port = free_port(), free_port()
        msg = (
            f"redis-server did not answer on port {node.port} within "
            f"{REDIS_START_TIMEOUT_S:.0f} s; "
            f"the end of {node.log_path}:\n{tail(node.log_path)}"
        )
        raise ServiceError(msg)

    def _answers(self, node: RedisProcess) -> bool:
        import redis

        client = self.node_client(node.port)
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        while time.monotonic() < deadline and running(node.proc):
            with contextlib.suppress(
                redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError
            ):
                if client.ping():
                    return True
            time.sleep(POLL_INTERVAL_S / 2)
        return False

    def _create(self) -> None:
        cli = executable("redis-cli", "apt-get install -y redis-tools")
        addresses = [f"{LOOPBACK}:{node.port}" for node in self._nodes]
        cmd = [cli, "--cluster", "create", *addresses]
        cmd += ["--cluster-replicas", str(self.replicas_per_master), "--cluster-yes"]
        result = subprocess.run(
            cmd, capture_output=True, text=True, timeout=CLUSTER_CREATE_TIMEOUT_S, check=False
        )
        if result.returncode != 0:
            msg = (
                f"'redis-cli --cluster create' exited with status {result.returncode}; "
                f"expected it to join {len(addresses)} empty nodes. Its output:\n"
                f"{result.stdout[-3000:]}{result.stderr[-2000:]}"
            )
            raise ServiceError(msg)

    def kill_master(self, index: int) -> RedisNode:
        """SIGKILL the master serving the ``index``-th slot range (0 holds slot 0)."""
        masters = self.masters()
        if not 0 <= index < len(masters):
            msg = f"no master {index}: {len(masters)} live masters serve slots now"
            raise IndexError(msg)
        victim = masters[index]
        process = self._process(victim.port)
        if process.proc is not None:
            kill_tree(process.proc)
        self._last_kill = (victim, time.monotonic())
        return victim

    def cut_off_replicas(self, index: int) -> list[int]:
        """Freeze the replicas of the ``index``-th master and drop their links to it.

        What that master writes from now on reaches none of them (a replica that lags, as
        asynchronous replication allows): a failover then promotes a replica without those
        writes. :meth:`resume_nodes` lets the frozen processes run again. Returns their ports.
        """
        master = self.masters()[index]
        ports = [r.port for r in self.replicas() if r.master_id == master.node_id]
        for port in ports:
            proc = self._process(port).proc
            if proc is not None:
                os.kill(proc.pid, signal.SIGSTOP)
        self.node_client(master.port).execute_command("CLIENT", "KILL", "TYPE", "replica")
        return ports

    def resume_nodes(self, ports: list[int]) -> None:
        """Let nodes frozen by :meth:`cut_off_replicas` run again."""
        for port in ports:
            proc = self._process(port).proc
            if proc is not None and running(proc):
                os.kill(proc.pid, signal.SIGCONT)

    def wait_failover(self, timeout: float = FAILOVER_TIMEOUT_S) -> Failover:
        """Until a replica took over the killed master's slots and every live node is ok."""
        import redis

        if self._last_kill is None:
            msg = "wait_failover() follows kill_master(); no master was killed"
            raise ServiceError(msg)
        victim, killed_at = self._last_kill
        slot = victim.slots[0][0]

        def promoted() -> int | None:
            owners = set()
            try:
                for port in self.running_ports():
                    view = self.nodes(port)
                    owner = [n for n in view if n.role == "master" and n.serves(slot)]
                    if len(owner) != 1 or owner[0].failed or not self._state_ok(port):
                        return None
                    owners.add(owner[0].port)
            except redis.exceptions.RedisError:
                return None
            if len(owners) == 1 and victim.port not in owners:
                return owners.pop()
            return None

        new_port = wait_for(
            promoted,
            timeout,
            lambda: (
                f"no replica took over slot {slot} from killed master port {victim.port} within "
                f"{timeout:.0f} s (cluster-node-timeout {self.node_timeout_ms} ms); node logs are "
                f"in {self.directory}"
            ),
        )
        return Failover(victim.port, new_port, time.monotonic() - killed_at)

    def restart_node(self, port: int | None = None) -> float:
        """Start a killed node again (default: the last killed master) on its port and folder.

        It reads its AOF and ``nodes.conf``, learns that its slots moved to a newer master and
        rejoins as that master's replica. Returns the seconds until the cluster settled.
        """
        if port is None:
            if self._last_kill is None:
                msg = "restart_node() needs a port: no node was killed through kill_master()"
                raise ServiceError(msg)
            port = self._last_kill[0].port
        node = self._process(port)
        if running(node.proc):
            msg = f"node {port} is running; kill it before restarting it"
            raise ServiceError(msg)
        started = time.monotonic()
        self._start_node(node, executable("redis-server", "apt-get install -y redis-server"), False)
        self._wait_settled()
        return time.monotonic() - started

    def stop(self) -> None:
        """SIGKILL every node; their folders (AOF, ``nodes.conf``, ``redis.log``) stay."""
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        for node in self._nodes:
            if node.proc is not None:
                kill_tree(node.proc)

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

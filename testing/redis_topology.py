"""The nodes of a local Redis Cluster and what they say: addresses, clients, topology.

:class:`RedisClusterNodes` knows a cluster's nodes (their ports, folders and processes) and
asks them how the cluster stands: who serves which slots, which replicas follow whom, whether
every node agrees and is ``ok``. :class:`~onceflow.testing.redis_cluster.LocalRedisCluster`
adds starting, crashing and restarting them.
"""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onceflow.kernel.errors import ServiceError
from onceflow.testing.processes import LOOPBACK, running, wait_for
from onceflow.testing.services import free_port

if TYPE_CHECKING:
    import redis
    from redis.cluster import ClusterNode, RedisCluster

REDIS_MASTERS = 3
REPLICAS_PER_MASTER = 1
CLUSTER_NODE_TIMEOUT_MS = 1000
"""A master unreachable this long is suspected; its replica takes over ~1-2 s later."""
HASH_SLOTS = 16384
CLUSTER_READY_TIMEOUT_S = 60.0
REDIS_SOCKET_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class RedisNode:
    """One node as ``CLUSTER NODES`` describes it."""

    node_id: str
    port: int
    role: str
    """``"master"`` or ``"replica"``."""
    master_id: str | None
    """For a replica, the node id of its master."""
    slots: tuple[tuple[int, int], ...]
    """Inclusive slot ranges served (masters only)."""
    failed: bool
    """Flagged ``fail`` (agreed by a majority) or ``fail?`` (suspected by the observer)."""
    connected: bool

    def serves(self, slot: int) -> bool:
        """Whether ``slot`` falls in one of this node's ranges."""
        return any(first <= slot <= last for first, last in self.slots)

    @classmethod
    def parse(cls, line: str) -> RedisNode:
        """One line of ``CLUSTER NODES``: id addr flags master ping pong epoch link slots."""
        fields = line.split()
        address, flags = fields[1], set(fields[2].split(","))
        slots: list[tuple[int, int]] = []
        for item in fields[8:]:
            if item.startswith("["):  # a slot being migrated or imported
                continue
            first, _, last = item.partition("-")
            slots.append((int(first), int(last or first)))
        return cls(
            node_id=fields[0],
            port=int(address.split("@")[0].rsplit(":", 1)[1]),
            role="master" if "master" in flags else "replica",
            master_id=None if fields[3] == "-" else fields[3],
            slots=tuple(slots),
            failed=bool(flags & {"fail", "fail?"}),
            connected=fields[7] == "connected",
        )


@dataclass(frozen=True)
class NodeStats:
    """What one node holds: for reporting how keys spread over the cluster."""

    port: int
    role: str
    keys: int
    used_memory: int
    """Bytes, from ``INFO memory``."""


@dataclass
class RedisProcess:
    """One node's ports, folder (AOF, ``nodes.conf``, ``redis.log``) and process."""

    port: int
    bus_port: int
    directory: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        """The node's log file."""
        return self.directory / "redis.log"


class RedisClusterNodes:
    """The ``masters`` masters of a Redis Cluster on loopback, each with ``replicas`` replicas.

    Each node has its own folder under ``directory`` (AOF, ``nodes.conf``, ``redis.log``)
    and an explicit cluster bus port: the default bus port (port + 10000) overflows for a
    free port above 55535.
    """

    def __init__(
        self,
        masters: int = REDIS_MASTERS,
        replicas: int = REPLICAS_PER_MASTER,
        *,
        node_timeout_ms: int = CLUSTER_NODE_TIMEOUT_MS,
        directory: str | None = None,
    ) -> None:
        if masters < 3:
            msg = f"Redis Cluster needs at least 3 masters to vote, got masters={masters}"
            raise ValueError(msg)
        self.directory = Path(directory or tempfile.mkdtemp(prefix="onceflow-redis-cluster-"))
        self.master_count = masters
        self.replicas_per_master = replicas
        self.node_timeout_ms = node_timeout_ms
        count = masters * (1 + replicas)
        self._nodes = [
            RedisProcess(free_port(), free_port(), self.directory / f"node-{i}")
            for i in range(count)
        ]
        self._clients: dict[int, redis.Redis[str]] = {}

    # -- addresses --

    @property
    def ports(self) -> list[int]:
        """Every node's client port, running or not."""
        return [node.port for node in self._nodes]

    def running_ports(self) -> list[int]:
        """Client ports of the nodes whose process runs."""
        return [node.port for node in self._nodes if running(node.proc)]

    def killed_ports(self) -> list[int]:
        """Client ports of started nodes whose process is not running."""
        return [n.port for n in self._nodes if n.proc is not None and not running(n.proc)]

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT`` of a running node, for ``RedisCluster.from_url``."""
        running = self.running_ports()
        if not running:
            msg = "no node of this Redis Cluster is running; call start() or restart_node()"
            raise ServiceError(msg)
        return f"redis://{LOOPBACK}:{running[0]}"

    @property
    def startup_nodes(self) -> list[ClusterNode]:
        """Every running node, for ``RedisCluster(startup_nodes=...)``."""
        from redis.cluster import ClusterNode

        return [ClusterNode(LOOPBACK, port) for port in self.running_ports()]

    def client(self, **kwargs: Any) -> RedisCluster[Any]:
        """A redis-py cluster client on the running nodes (``kwargs`` go to ``RedisCluster``)."""
        from redis.cluster import RedisCluster

        return RedisCluster(startup_nodes=self.startup_nodes, **kwargs)

    def node_client(self, port: int) -> redis.Redis[str]:
        """A plain client of one node (strings decoded), for node-level commands."""
        import redis

        if port not in self._clients:
            self._clients[port] = redis.Redis(
                host=LOOPBACK,
                port=port,
                decode_responses=True,
                socket_timeout=REDIS_SOCKET_TIMEOUT_S,
                socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S,
            )
        return self._clients[port]

    # -- topology --

    def nodes(self, port: int | None = None) -> list[RedisNode]:
        """The cluster as node ``port`` (default: the first running node) sees it."""
        observer = port if port is not None else self._observer()
        text = str(self.node_client(observer).execute_command("CLUSTER", "NODES"))
        return [RedisNode.parse(line) for line in text.splitlines() if line.strip()]

    def masters(self) -> list[RedisNode]:
        """Masters serving slots and not failed, in slot order: ``masters()[0]`` has slot 0."""
        serving = [n for n in self.nodes() if n.role == "master" and n.slots and not n.failed]
        return sorted(serving, key=lambda n: n.slots[0][0])

    def replicas(self) -> list[RedisNode]:
        """Replicas not failed, by port."""
        return sorted(
            (n for n in self.nodes() if n.role == "replica" and not n.failed),
            key=lambda n: n.port,
        )

    def slot_owner(self, slot: int) -> RedisNode:
        """The live master serving ``slot``."""
        if not 0 <= slot < HASH_SLOTS:
            msg = f"slot {slot} is out of range: Redis Cluster slots are 0..{HASH_SLOTS - 1}"
            raise ValueError(msg)
        for node in self.masters():
            if node.serves(slot):
                return node
        msg = f"no live master serves slot {slot}; wait_failover() if a master was killed"
        raise ServiceError(msg)

    def node_stats(self) -> list[NodeStats]:
        """Keys (DBSIZE) and used memory of every running node, by port."""
        stats = []
        for port in self.running_ports():
            client = self.node_client(port)
            role = client.info("replication")["role"]
            stats.append(
                NodeStats(
                    port=port,
                    role="master" if role == "master" else "replica",
                    keys=int(client.dbsize()),
                    used_memory=int(client.info("memory")["used_memory"]),
                )
            )
        return stats

    def _observer(self) -> int:
        running = self.running_ports()
        if not running:
            msg = "no node of this Redis Cluster is running; call start() or restart_node()"
            raise ServiceError(msg)
        return running[0]

    def cluster_info(self, port: int) -> dict[str, str]:
        """``CLUSTER INFO`` of node ``port`` as a dict (``cluster_state``, ...)."""
        info = str(self.node_client(port).execute_command("CLUSTER", "INFO"))
        return dict(line.split(":", 1) for line in info.splitlines() if ":" in line)

    def _state_ok(self, port: int) -> bool:
        return self.cluster_info(port).get("cluster_state") == "ok"

    def _settled_view(self, port: int) -> bool:
        """Node ``port`` sees every master with its replicas, nobody failed, and is ok."""
        view = self.nodes(port)
        if any(n.failed or not n.connected for n in view):
            return False
        masters = [n for n in view if n.role == "master" and n.slots]
        replicas = [n for n in view if n.role == "replica"]
        return (
            len(masters) == self.master_count
            and all(
                sum(r.master_id == m.node_id for r in replicas) == self.replicas_per_master
                for m in masters
            )
            and self._state_ok(port)
            and int(self.cluster_info(port)["cluster_known_nodes"]) == len(self._nodes)
        )

    def _replica_linked(self, port: int) -> bool:
        info = self.node_client(port).info("replication")
        return info["role"] == "master" or info.get("master_link_status") == "up"

    def _wait_settled(self) -> None:
        """Until every node runs, agrees on the full topology and every replica is in sync."""
        import redis

        def settled() -> bool | None:
            if self.killed_ports():
                msg = f"nodes {self.killed_ports()} are not running; restart_node() them first"
                raise ServiceError(msg)
            ports = self.running_ports()
            try:
                ok = all(self._settled_view(p) and self._replica_linked(p) for p in ports)
            except redis.exceptions.RedisError:
                return None
            return True if ok else None

        wait_for(
            settled,
            CLUSTER_READY_TIMEOUT_S,
            lambda: (
                f"the Redis Cluster on ports {self.ports} did not settle (cluster_state:ok, "
                f"{self.master_count} masters with {self.replicas_per_master} linked replica(s) "
                f"each) within {CLUSTER_READY_TIMEOUT_S:.0f} s; node logs are in {self.directory}"
            ),
        )

    def _process(self, port: int) -> RedisProcess:
        for node in self._nodes:
            if node.port == port:
                return node
        msg = f"no node of this cluster listens on port {port}; its ports are {self.ports}"
        raise ServiceError(msg)

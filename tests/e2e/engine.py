"""A container engine for the end-to-end tests: Docker when one answers, else Podman.

Detection is fast (a ping with a 0.5 s timeout, only when a socket exists). With Docker and a
registry the official ``apache/kafka`` and ``redis`` images are used. Without Docker, Podman
(Debian's, as root) is set up the way that works on machines with no registry:

* a private ``containers.conf`` (``runtime = "runc"``, ``cgroup_manager = "cgroupfs"``, ulimits
  within the machine's hard limits), passed through ``CONTAINERS_CONF``;
* ``podman system service`` on a private socket, which testcontainers drives as Docker;
* images built locally and cached by Podman between runs: a Debian base from debootstrap,
  a Redis image on it, and an Apache Kafka image on it: Debian's Java 17 from apt plus the
  same jars that ``onceflow.testing.kafka_jars.fetch_kafka`` caches for ``LocalKafka``. Containers
  use the host network (ports chosen by the tests).

The Kafka image runs a single-node KRaft broker configured by ``KAFKA_*`` environment
variables, the convention of the official ``apache/kafka`` image (``KAFKA_LOG_DIRS`` becomes
``log.dirs``; ``__`` stands for ``_`` and ``___`` for ``-``); ``kafka_env`` gives the settings
``LocalKafka`` uses. Its storage is formatted on the first start only, in ``KAFKA_DATA``,
which the tests bind-mount from the host so that stopping and starting the container keeps
every record.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

from onceflow.kernel.errors import ServiceError
from onceflow.testing.kafka_config import (
    JVM_OPTIONS,
    LOG4J2_PROPERTIES,
    MAIN_CLASS,
    STORAGE_TOOL_CLASS,
    broker_properties,
    new_cluster_id,
)
from onceflow.testing.kafka_jars import KAFKA_VERSION, fetch_kafka

HERE = os.path.join(tempfile.gettempdir(), "onceflow-podman")
SOCKET = os.path.join(HERE, "podman.sock")
BASE_IMAGE = "localdebian:12"
REDIS_IMAGE = "onceflow-e2e-redis:1"
# Mounted from the host by the tests; the broker's log.dirs is its data/ folder.
KAFKA_DATA = "/var/lib/kafka"
KAFKA_CONTAINERFILE = f"""FROM {BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends openjdk-17-jre-headless \\
 && rm -rf /var/lib/apt/lists/*
COPY libs/ /opt/kafka/libs/
COPY log4j2.properties entrypoint.sh /opt/kafka/
ENTRYPOINT ["/bin/sh", "/opt/kafka/entrypoint.sh"]
"""
KAFKA_ENTRYPOINT = f"""#!/bin/sh
# A single-node Apache Kafka configured by KAFKA_* variables (KAFKA_LOG_DIRS=/x -> log.dirs=/x;
# __ stands for _ and ___ for -), formatted on the first start with $CLUSTER_ID.
set -eu
conf=/opt/kafka/server.properties
env | grep '^KAFKA_' | while IFS='=' read -r name value; do
  key=$(printf '%s' "${{name#KAFKA_}}" | tr '[:upper:]' '[:lower:]' \\
    | sed -e 's/___/-/g' -e 's/__/@/g' -e 's/_/./g' -e 's/@/_/g')
  printf '%s=%s\\n' "$key" "$value"
done > "$conf"
java="java {" ".join(JVM_OPTIONS)} -Dlog4j2.configurationFile=/opt/kafka/log4j2.properties"
logdir=$(sed -n 's/^log[.]dirs=//p' "$conf")
if [ ! -f "$logdir/meta.properties" ]; then
  $java -cp '/opt/kafka/libs/*' {STORAGE_TOOL_CLASS} format \\
    -t "${{CLUSTER_ID:?set CLUSTER_ID}}" -c "$conf"
fi
exec $java -cp '/opt/kafka/libs/*' {MAIN_CLASS} "$conf"
"""
# The tag changes whenever what goes into the image (besides the jars' version) changes.
_KAFKA_IMAGE_DIGEST = hashlib.sha256(
    (KAFKA_CONTAINERFILE + KAFKA_ENTRYPOINT + LOG4J2_PROPERTIES).encode()
).hexdigest()[:8]
KAFKA_IMAGE = f"onceflow-e2e-kafka:{KAFKA_VERSION}-{_KAFKA_IMAGE_DIGEST}"
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


@dataclass
class Engine:
    """What the tests run containers with."""

    kind: str  # "docker" or "podman"
    redis_image: str
    broker_image: str
    host_network: bool


def _ping(timeout: float = 0.5) -> bool:
    try:
        import docker

        docker.from_env(timeout=timeout).ping()
        return True
    except Exception:  # noqa: BLE001 - any failure means "no engine here"
        return False


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)  # type: ignore[call-overload]


def _podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CONTAINERS_CONF": os.path.join(HERE, "containers.conf")}
    return subprocess.run(
        ["podman", *args], check=check, capture_output=True, text=True, env=env, timeout=1200
    )


def _has_image(name: str) -> bool:
    return _podman("image", "exists", name, check=False).returncode == 0


def _mirror() -> str:
    for path in glob.glob("/etc/apt/sources.list.d/*.sources"):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("URIs:") and "debian" in line:
                    return line.split()[1]
    return "http://deb.debian.org/debian"


def _build_images(log: list[str]) -> None:
    if not _has_image(BASE_IMAGE):
        rootfs = tempfile.mkdtemp(prefix="onceflow-rootfs-")
        t0 = time.monotonic()
        _run(["debootstrap", "--variant=minbase", "bookworm", rootfs, _mirror()], timeout=1200)
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        env = {**os.environ, "CONTAINERS_CONF": os.path.join(HERE, "containers.conf")}
        subprocess.run(
            ["podman", "import", "-", BASE_IMAGE],
            stdin=tar.stdout,
            check=True,
            env=env,
            capture_output=True,
        )
        tar.wait()
        shutil.rmtree(rootfs, ignore_errors=True)
        log.append(f"built {BASE_IMAGE} with debootstrap in {time.monotonic() - t0:.0f} s")
    if not _has_image(REDIS_IMAGE):
        ctx = tempfile.mkdtemp(prefix="onceflow-redis-img-")
        with open(os.path.join(ctx, "Containerfile"), "w", encoding="utf-8") as fh:
            fh.write(
                f"FROM {BASE_IMAGE}\n"
                "RUN apt-get update && apt-get install -y --no-install-recommends redis-server"
                " && rm -rf /var/lib/apt/lists/*\n"
                'ENTRYPOINT ["redis-server"]\n'
            )
        _podman("build", "-t", REDIS_IMAGE, ctx)
        log.append(f"built {REDIS_IMAGE}")
    if not _has_image(KAFKA_IMAGE):
        _build_kafka_image(log)


def _build_kafka_image(log: list[str]) -> None:
    """Java from Debian's apt, Kafka's jars from the cache ``LocalKafka`` uses."""
    t0 = time.monotonic()
    libs = fetch_kafka() / "libs"
    ctx = tempfile.mkdtemp(prefix="onceflow-kafka-img-")
    try:
        shutil.copytree(libs, os.path.join(ctx, "libs"))
        for name, text in (
            ("Containerfile", KAFKA_CONTAINERFILE),
            ("entrypoint.sh", KAFKA_ENTRYPOINT),
            ("log4j2.properties", LOG4J2_PROPERTIES),
        ):
            with open(os.path.join(ctx, name), "w", encoding="utf-8") as fh:
                fh.write(text)
        _podman("build", "-t", KAFKA_IMAGE, ctx)
    finally:
        shutil.rmtree(ctx, ignore_errors=True)
    log.append(f"built {KAFKA_IMAGE} in {time.monotonic() - t0:.0f} s")


def kafka_env(port: int, controller_port: int, cluster_id: str | None = None) -> dict[str, str]:
    """The Kafka image's environment: ``LocalKafka``'s settings on the host's loopback."""
    props = broker_properties(port, controller_port, f"{KAFKA_DATA}/data")
    env = {
        "KAFKA_" + key.replace("_", "__").replace("-", "___").replace(".", "_").upper(): value
        for key, value in props.items()
    }
    return {**env, "CLUSTER_ID": cluster_id or new_cluster_id()}


def _stop_doubled_services() -> None:
    """Stop every service on our socket when there is more than one.

    Two services left on one socket by earlier runs (each started when the other did not
    answer in time) both answer a ping, but containers they start fail with "write child:
    broken pipe": start one afresh instead.
    """
    found = subprocess.run(
        ["pgrep", "-f", f"podman system service .*{SOCKET}"],
        check=False,
        capture_output=True,
        text=True,
    )
    pids = [int(p) for p in found.stdout.split()]
    if len(pids) < 2:
        return
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SOCKET)


def _start_service() -> None:
    os.makedirs(HERE, exist_ok=True)
    with open(os.path.join(HERE, "containers.conf"), "w", encoding="utf-8") as fh:
        fh.write(CONTAINERS_CONF)
    os.environ["DOCKER_HOST"] = f"unix://{SOCKET}"
    _stop_doubled_services()
    if os.path.exists(SOCKET) and _ping(1.0):
        return
    env = {**os.environ, "CONTAINERS_CONF": os.path.join(HERE, "containers.conf")}
    log = open(os.path.join(HERE, "service.log"), "ab")  # noqa: SIM115
    subprocess.Popen(
        ["podman", "system", "service", "--time=0", f"unix://{SOCKET}"],
        env=env,
        stdout=log,
        stderr=log,
        start_new_session=True,
        cwd=HERE,  # outlives the checkout that started it (a later run may reuse the service)
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if os.path.exists(SOCKET) and _ping(1.0):
            return
        time.sleep(0.2)
    msg = f"podman system service did not answer on {SOCKET} (see {HERE}/service.log)"
    raise RuntimeError(msg)


def find_engine(log: list[str]) -> tuple[Engine | None, str]:
    """An engine, or None and why not (in well under a second when there is none)."""
    has_socket = os.environ.get("DOCKER_HOST") or os.path.exists("/var/run/docker.sock")
    if has_socket and not os.environ.get("DOCKER_HOST", "").endswith("podman.sock"):
        if _ping():
            return Engine("docker", "redis:7", f"apache/kafka:{KAFKA_VERSION}", False), "docker"
    if shutil.which("podman") is None:
        return None, "no Docker daemon answers and podman is not installed"
    if os.geteuid() != 0:
        return None, "no Docker daemon answers and podman needs root here"
    if shutil.which("runc") is None or shutil.which("debootstrap") is None:
        return None, "podman needs runc and debootstrap (./quickstart.sh test installs them)"
    try:
        _start_service()
        _build_images(log)
    except (subprocess.CalledProcessError, RuntimeError, OSError, ServiceError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        return None, f"podman could not be set up: {exc} {detail[-800:]}"
    os.environ["TESTCONTAINERS_RYUK_DISABLED"] = "true"
    return Engine("podman", REDIS_IMAGE, KAFKA_IMAGE, True), "podman"

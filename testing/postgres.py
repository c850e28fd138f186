"""A real PostgreSQL server for tests and the demo: Debian's ``postgresql``, on a free port.

It runs as the ``postgres`` user when started by root (PostgreSQL refuses to run as root),
in a fresh data directory, with password (SCRAM) authentication over TCP, the way a sink
meets a production server, and ``wal_level=logical`` so that change data capture can read it.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from onceflow.kernel.errors import ServiceError
from onceflow.testing.services import free_port, track_process, wait_port

USER = "onceflow"
PASSWORD = "onceflow-test-password"  # a test server's; real ones come from PGPASSWORD


def postgres_bin() -> str | None:
    """The folder of the newest installed PostgreSQL's server programs, if any."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
    return os.path.dirname(found[-1]) if found else None


@dataclass
class LocalPostgres:
    """``initdb`` + ``postgres`` in a temporary folder; :meth:`stop` removes it.

    A ``folder`` that already holds a cluster is started again as it is (``keep=True``:
    :meth:`stop` leaves it, as ``onceflow dev down`` does).
    """

    port: int = field(default_factory=free_port)
    folder: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="onceflow-pg-"))
    proc: subprocess.Popen[bytes] | None = None
    keep: bool = False

    @property
    def conninfo(self) -> str:
        """What a client connects with (the password comes separately)."""
        return f"host=127.0.0.1 port={self.port} dbname=postgres user={USER}"

    def start(self) -> LocalPostgres:
        """Create the cluster and start the server; a clear error if PostgreSQL is missing."""
        binaries = postgres_bin()
        if binaries is None:
            msg = "PostgreSQL is not installed: apt-get install postgresql (./quickstart.sh does)"
            raise ServiceError(msg)
        data = os.path.join(self.folder, "data")
        if not os.path.exists(os.path.join(data, "PG_VERSION")):
            self._initdb(binaries, data)
        settings = [
            "-c", f"port={self.port}", "-c", "listen_addresses=127.0.0.1",
            "-c", f"unix_socket_directories={self.folder}", "-c", "fsync=on",
            "-c", "max_connections=100",
            "-c", "wal_level=logical",  # change data capture (Debezium, a replication slot)
        ]  # fmt: skip
        cmd = [*self._as_postgres(), f"{binaries}/postgres", "-D", data, *settings]
        log = open(os.path.join(self.folder, "server.log"), "ab")  # noqa: SIM115
        self.proc = track_process(
            subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        )
        wait_port(self.port, self.proc, "postgres", 60)
        deadline = time.monotonic() + 60
        ready = [f"{binaries}/pg_isready", "-h", "127.0.0.1", "-p", str(self.port), "-q"]
        while subprocess.run(ready, check=False).returncode != 0:  # the port opens first
            if time.monotonic() > deadline or self.proc.poll() is not None:
                msg = f"postgres did not become ready (see {self.folder}/server.log)"
                raise ServiceError(msg)
            time.sleep(0.1)
        return self

    def _initdb(self, binaries: str, data: str) -> None:
        """A new cluster in ``data``, its user's password :data:`PASSWORD`."""
        pwfile = os.path.join(self.folder, "pw")
        with open(pwfile, "w", encoding="utf-8") as fh:
            fh.write(PASSWORD)
        if os.geteuid() == 0:  # PostgreSQL will not run as root
            owner = pwd.getpwnam("postgres")
            os.chown(self.folder, owner.pw_uid, owner.pw_gid)
            os.chown(pwfile, owner.pw_uid, owner.pw_gid)
        self._run(
            f"{binaries}/initdb",
            "-D",
            data,
            "-U",
            USER,
            f"--pwfile={pwfile}",
            "--auth-host=scram-sha-256",
            "--auth-local=trust",
            "-E",
            "UTF8",
        )

    def stop(self) -> None:
        """Stop the server and remove its folder."""
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if not self.keep:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _as_postgres(self) -> list[str]:
        return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def _run(self, *cmd: str) -> None:
        done = subprocess.run(
            [*self._as_postgres(), *cmd], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            msg = f"{os.path.basename(cmd[0])} failed: {done.stderr.strip()[-400:]}"
            raise ServiceError(msg)

"""Jars from Maven Central through ``mvn``, fetched once per machine.

What every fetch of ours shares (Spark's Kafka connector here, and the test services' Kafka
broker and schema registry in :mod:`onceflow.testing`): a lock file, so that processes
fetching at once download once; one ``mvn`` command line, quiet, colourless and retrying what
an earlier failed attempt marked missing, bounded in time; and the first lines of what Maven
said when it failed, for a one-line error. Each caller keeps its own folder layout and says
its own error (what was expected, and how else to get the jars).
"""

from __future__ import annotations

import contextlib
import fcntl
import re
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
DOWNLOAD_TIMEOUT_S = 900.0
ERROR_LINES = 3
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) for the block."""
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run_mvn(
    mvn: str, goal: Sequence[str], cwd: str
) -> tuple[list[str], subprocess.CompletedProcess[str] | None]:
    """Run ``mvn`` with ``goal`` (a plugin goal and its ``-D`` settings) in ``cwd``.

    Returns the command line and its result (None: it timed out).
    """
    cmd = [
        mvn,
        "-B",
        "-q",
        "-Dstyle.color=never",
        "-U",  # retry artifacts that an earlier, failed attempt marked as missing
        *goal,
    ]
    try:
        done = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return cmd, None
    return cmd, done


def copy_dependencies(
    mvn: str, artifact_id: str, deps: Sequence[tuple[str, str, str]], into: Path
) -> tuple[list[str], subprocess.CompletedProcess[str] | None]:
    """Copy ``deps`` (group, artifact, version) and their runtime dependencies into ``into``."""
    body = "".join(
        f"<dependency><groupId>{g}</groupId><artifactId>{a}</artifactId>"
        f"<version>{v}</version></dependency>\n"
        for g, a, v in deps
    )
    pom = (
        '<project xmlns="http://maven.apache.org/POM/4.0.0">\n'
        "<modelVersion>4.0.0</modelVersion>\n"
        f"<groupId>onceflow.local</groupId><artifactId>{artifact_id}</artifactId>"
        "<version>1</version><packaging>pom</packaging>\n"
        f"<dependencies>\n{body}</dependencies>\n</project>\n"
    )
    with tempfile.TemporaryDirectory(prefix=f"onceflow-{artifact_id}-") as work:
        Path(work, "pom.xml").write_text(pom, encoding="utf-8")
        goal = [
            f"{DEPENDENCY_PLUGIN}:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={into}",
        ]
        return run_mvn(mvn, goal, work)


def maven_errors(done: subprocess.CompletedProcess[str] | None) -> str:
    """Maven's first few error lines (its first lines when none says [ERROR]), joined.

    Its boilerplate ``[ERROR]`` lines with nothing after them are left out; a run that timed
    out says so.
    """
    if done is None:
        return "nothing (timed out)"
    lines = _ANSI_ESCAPE.sub("", done.stdout + done.stderr).splitlines()
    errors = [
        line for line in lines if line.startswith("[ERROR]") and line[len("[ERROR]") :].strip()
    ]
    return "\n".join((errors or lines)[:ERROR_LINES]) or "nothing"

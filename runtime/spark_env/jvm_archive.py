"""A class-data archive of the Spark driver's JVM: a run (and a restart) starts ~1.5 s sooner.

A Spark driver loads some 15,000 classes before its first micro-batch; most of a session's
start is spent parsing and verifying them. Java's dynamic class-data sharing (CDS) writes the
classes a JVM loaded into an archive when it exits (``-XX:ArchiveClassesAtExit``); a JVM
started with ``-XX:SharedArchiveFile`` maps them instead. Measured here: session start
3.4 -> 2.0-2.5 s, the first Spark job 1.3 -> 0.6 s, so a restart after a crash reaches its
first micro-batch sooner.

:func:`build` makes the archive once per machine, Java and PySpark install (``onceflow
jvm-cache``; the quick start runs it): a child process starts a session as every run does and
exercises what a streaming run loads (a Python streaming data source, ``foreachBatch``,
``mapInArrow``, a shuffle), then stops cleanly, which is when the JVM writes the archive.
:func:`driver_options` adds it to a driver's Java options when it exists. The archive is
only an optimization: a missing or stale one (another Java or PySpark) is ignored silently by
the JVM, and the run starts as it would have.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from onceflow.kernel.errors import OnceflowError
from onceflow.runtime.spark_env.jvm import DUMP_ENV, archive_path

BUILD_TIMEOUT_S = 300
STALE_S = 14 * 24 * 3600
MODULE = "onceflow.runtime.spark_env.jvm_archive"


def build(force: bool = False) -> str | None:
    """Make the archive (in a child process); return its path, None where none can be made.

    Safe to run twice and concurrently: an existing archive is kept unless ``force``, and a
    new one replaces it in one rename.
    """
    path = archive_path()
    if path is None:
        return None
    if os.path.isfile(path) and not force:
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".jsa.partial")
    os.close(fd)
    os.unlink(partial)  # the JVM writes it at exit
    try:
        done = subprocess.run(
            [sys.executable, "-m", MODULE, "--child"],
            env={**os.environ, DUMP_ENV: partial},
            check=False,
            timeout=BUILD_TIMEOUT_S,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        if done.returncode != 0 or not os.path.isfile(partial):
            tail = " ".join(done.stderr.strip().splitlines()[-1:])[:300]
            msg = f"the JVM class-data archive was not made (runs start without it): {tail}"
            raise JvmArchiveError(msg)
        os.replace(partial, path)
        _forget_old(path)
        return path
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


class JvmArchiveError(OnceflowError):
    """The warm-up run that writes the archive failed."""


def _forget_old(keep: str) -> None:
    """Remove archives of other installs not made for two weeks (~170 MB each)."""
    folder = os.path.dirname(keep)
    for name in os.listdir(folder):
        other = os.path.join(folder, name)
        if other == keep or not name.startswith("spark-driver-") or not name.endswith(".jsa"):
            continue
        with contextlib.suppress(OSError):
            if time.time() - os.stat(other).st_mtime > STALE_S:
                os.unlink(other)


# -- the warm-up child --------------------------------------------------------------------


def _identity(batches: Iterator[Any]) -> Iterator[Any]:
    yield from batches


def _warm_up() -> None:
    """Load what a streaming run loads, in a session whose JVM writes the archive at exit."""
    from pyspark.sql.datasource import (
        DataSource,
        DataSourceStreamReader,
        InputPartition,
    )

    from onceflow.runtime.spark_env.session import DEFAULT_MASTER, spark_session

    class _Reader(DataSourceStreamReader):
        def initialOffset(self) -> dict[str, int]:  # noqa: N802 - Spark's name
            return {"n": 0}

        def latestOffset(self, start: dict[str, int], limit: Any) -> dict[str, int]:  # noqa: N802
            return {"n": min(start["n"] + 100, 300)}

        def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[Any]:
            return [InputPartition((start["n"], end["n"]))]

        def read(self, partition: Any) -> Iterator[tuple[int, bytes]]:
            lo, hi = partition.value
            for i in range(lo, hi):
                yield (i, str(i).encode())

        def commit(self, end: dict[str, int]) -> None:
            """Nothing to release."""

    class _Source(DataSource):
        @classmethod
        def name(cls) -> str:
            return "onceflow_warmup"

        def schema(self) -> str:
            return "id long, value binary"

        def streamReader(self, schema: Any) -> DataSourceStreamReader:  # noqa: N802
            return _Reader()

    session = spark_session(DEFAULT_MASTER, app_name="onceflow-jvm-cache")
    session.dataSource.register(_Source)
    schema = "id long, value binary"

    def each_batch(df: Any, batch_id: int) -> None:
        session.sparkContext.setLocalProperty("onceflow.batch.id", str(batch_id))
        shuffled = df.mapInArrow(_identity, schema).repartition(2, "value")
        shuffled.mapInArrow(_identity, schema).where("id < 0").collect()

    with tempfile.TemporaryDirectory(prefix="onceflow-jvm-cache-") as folder:
        query = (
            session.readStream.format("onceflow_warmup")
            .load()
            .writeStream.foreachBatch(each_batch)
            .option("checkpointLocation", os.path.join(folder, "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
        failed = query.exception()
    jvm = getattr(session.sparkContext._gateway, "proc", None)  # noqa: SLF001
    session.stop()
    if jvm is not None:  # it writes the archive as it exits: wait for that
        jvm.stdin.close()
        jvm.wait(BUILD_TIMEOUT_S)
    if failed is not None:
        msg = f"the warm-up query failed: {failed}"
        raise JvmArchiveError(msg)


def main(argv: list[str] | None = None) -> None:
    """``python -m onceflow.runtime.spark_env.jvm_archive [--force]`` (``onceflow jvm-cache``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="build it again")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _warm_up()
        return
    try:
        path = build(args.force)
    except JvmArchiveError as exc:
        print(f"onceflow jvm-cache: {exc}", file=sys.stderr)
        sys.exit(1)
    print(path or "no archive: Java or PySpark not found, or ONCEFLOW_JVM_ARCHIVE=0")


if __name__ == "__main__":
    main()

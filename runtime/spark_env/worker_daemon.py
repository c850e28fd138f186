"""Spark's Python worker daemon, started warm: ``spark.python.daemon.module`` points here.

Spark forks every Python worker from a daemon process and each worker then imports what its
tasks need (pyspark's worker, pyarrow, pandas, Onceflow, the Kafka and Redis clients). Measured
on the keyed-count benchmark, that was the largest single cost of a query's first micro-batch:
1.5-2.5 s of CPU per worker, with four workers starting at once on two cores. Two things made
it slow, and this module removes both before handing over to :func:`pyspark.daemon.manager`:

* Spark puts ``pyspark.zip``, py4j's zip and its core jar first on the workers'
  ``PYTHONPATH``. Modules imported from a zip are compiled from source in every new process
  (no bytecode cache can be written into a zip), and every task's
  ``importlib.invalidate_caches()`` re-reads the directories of the zips and of the jar
  (6,000 entries). The jar holds no Python and goes. When the installed pyspark (and py4j)
  beside Onceflow is the very same version as the zip, the zips go too, so the installed
  packages' cached bytecode is used. A different version (a cluster's own Spark) keeps the
  zips: the workers must match the JVM.
* The daemon imports the workers' modules once, before it forks them, so each worker starts
  with them loaded. PySpark does not do this itself because a fork is only safe while the
  process has a single thread, and pyarrow's jemalloc and numpy's OpenBLAS start threads on
  import. Here they are told not to (``JE_ARROW_MALLOC_CONF``, ``OPENBLAS_NUM_THREADS``,
  unless the environment already says otherwise), and the thread count is checked after the
  imports: if any module started a thread anyway, the daemon starts again without preloading
  (``ONCEFLOW_WORKER_PRELOAD=0``), as PySpark's own would. The same variable switches it off.

A worker whose JVM side hung up (its task failed or was cancelled, and the JVM closed the
socket) used to print a ``BrokenPipeError`` traceback to the run's terminal when it flushed
its last bytes: nobody is left to read them, so it ends quietly instead
(:func:`quiet_when_hung_up`); the JVM's log has the task's fate.

PySpark's daemon runs a full ``gc.collect()`` in a reused worker after every task: with the
preloaded modules that walked ~110,000 objects, 66 ms per task (py-spy put 1.7 s of CPU per
100k records of the keyed-count benchmark in the daemon's ``manager`` frame). The daemon
freezes what it imported (``gc.freeze()``, meant for servers that fork) before it forks, so a
worker's collections only walk what its tasks made (a few µs); it also keeps the imported
objects' pages shared, as collections no longer write to them.

A forked worker inherits the daemon's module state. Python's ``random`` reseeds itself in a
forked child; numpy's global generator does not, so it is reseeded here in every child (two
workers must not draw the same "random" numbers).
"""

from __future__ import annotations

import gc
import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
import zipfile
from collections.abc import Callable
from typing import Any

MODULE = "onceflow.runtime.spark_env.worker_daemon"  # what spark.python.daemon.module names
PRELOAD_ENV = "ONCEFLOW_WORKER_PRELOAD"
# Imported by the workers of a streaming run; optional ones are skipped when not installed.
PRELOAD = (
    "pyspark.worker",
    "pyspark.sql.pandas.serializers",
    "pyspark.sql.worker.plan_data_source_read",
    "pyarrow",
    "pandas",
    "kafka",
    "redis",
    "pybloom_live",
    "onceflow.runtime.task.loop",
    "onceflow.dedup.guard",
    "onceflow.connectors.kafka.worker",
    "onceflow.connectors.kafka.datasource",
    "onceflow.connectors.kafka.sink",
    # ``import onceflow`` no longer imports the API (PEP 562, see onceflow/__init__.py), and
    # tasks unpickle what a pipeline refers to (its combiners, windows, ...): measured, each
    # worker of a restart's first batch imported onceflow.pipeline for ~0.3 s without this.
    "onceflow.pipeline",
    "onceflow.pipeline.windows",
    "onceflow.pipeline.state",
    "onceflow.pipeline.codecs",
    "onceflow.connectors.kafka.source",
    "onceflow.runtime.driver.result",
    "onceflow.runtime.spark_env.session",  # the warm-up task's function (warm_workers)
)
OPTIONAL = frozenset({"pybloom_live"})
# Libraries that start threads on import unless told not to (only set when unset).
SINGLE_THREAD_ENV = {
    "JE_ARROW_MALLOC_CONF": "background_thread:false",
    "OPENBLAS_NUM_THREADS": "1",
}
_VERSION = re.compile(r"""__version__\s*(?::\s*str\s*)?=\s*["']([^"']+)["']""")
# package -> (file in the zip and in the installed package that holds its version)
_ZIPPED = {"pyspark": "pyspark/version.py", "py4j": "py4j/version.py"}


def _version_in(text: str) -> str | None:
    found = _VERSION.search(text)
    return found.group(1) if found else None


def _zip_version(path: str, member: str) -> str | None:
    try:
        with zipfile.ZipFile(path) as zf:
            return _version_in(zf.read(member).decode())
    except (OSError, KeyError, zipfile.BadZipFile, UnicodeDecodeError):
        return None


def _installed_version(package: str, member: str, path: list[str]) -> str | None:
    spec = importlib.machinery.PathFinder.find_spec(package, path)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    try:
        with open(os.path.join(folder, os.path.basename(member)), encoding="utf-8") as fh:
            return _version_in(fh.read())
    except OSError:
        return None


def _python_free_jar(entry: str) -> bool:
    """Whether ``entry`` is a jar holding no Python module (Spark adds its core jar)."""
    if not entry.endswith(".jar"):
        return False
    try:
        with zipfile.ZipFile(entry) as zf:
            return not any(n.endswith((".py", ".pyc")) for n in zf.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def prefer_installed(path: list[str]) -> list[str]:
    """``path`` without the zips whose package is installed elsewhere on it, same version.

    Jars without Python in them go too: nothing can be imported from them, and each is a
    directory of thousands of entries for ``invalidate_caches`` to re-read.
    """
    unzipped = [p for p in path if not p.endswith((".zip", ".jar"))]
    keep: list[str] = []
    for entry in path:
        if _python_free_jar(entry):
            continue
        package = next(
            (
                name
                for name in _ZIPPED
                if entry.endswith(".zip") and os.path.basename(entry).startswith(name)
            ),
            None,
        )
        if package is not None:
            member = _ZIPPED[package]
            zipped = _zip_version(entry, member)
            if zipped is not None and zipped == _installed_version(package, member, unzipped):
                continue
        keep.append(entry)
    return keep


def threads() -> int:
    """Threads of this process (Linux; 1 where that cannot be read)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def preload(modules: tuple[str, ...] = PRELOAD) -> list[str]:
    """Import ``modules`` (those installed); return the names imported."""
    done: list[str] = []
    for name in modules:
        if name in OPTIONAL and importlib.util.find_spec(name) is None:
            continue
        importlib.import_module(name)
        done.append(name)
    return done


def _reseed_numpy() -> None:
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _restart_without_preload(started: int) -> None:
    print(
        f"onceflow worker daemon: {started} threads after preloading; starting again without "
        "it (forking a process with threads is unsafe)",
        file=sys.stderr,
        flush=True,
    )
    os.environ[PRELOAD_ENV] = "0"
    os.execv(sys.executable, [sys.executable, "-m", MODULE, *sys.argv[1:]])


def drop_from_path(gone: tuple[str, ...]) -> None:
    """Take ``gone`` off ``sys.path`` with everything already found through it.

    Zip importers made while this module was being found would otherwise stay in
    ``sys.path_importer_cache`` (every task's ``invalidate_caches()`` re-reads them), and so
    would namespace packages found only there (the jar's ``org``, made by the standard
    library's ``from org.python.core import ...`` probes for Jython).
    """
    if not gone:
        return
    sys.path[:] = [p for p in sys.path if p not in gone]
    for cached in [p for p in sys.path_importer_cache if p.startswith(gone)]:
        del sys.path_importer_cache[cached]
    for name, module in list(sys.modules.items()):
        where = [str(w) for w in getattr(module, "__path__", None) or []]
        if where and getattr(module, "__file__", None) is None:
            if all(w.startswith(gone) for w in where):
                del sys.modules[name]


def warm_up() -> None:
    """Preload the workers' modules, unless switched off or unsafe (see the module doc)."""
    if os.environ.get(PRELOAD_ENV, "1") == "0" or threads() > 1:
        return
    for name, value in SINGLE_THREAD_ENV.items():
        os.environ.setdefault(name, value)
    preload()
    started = threads()
    if started > 1:
        _restart_without_preload(started)
    os.register_at_fork(after_in_child=_reseed_numpy)


def quiet_when_hung_up(worker: Callable[..., int]) -> Callable[..., int]:
    """``worker`` (PySpark's per-connection function) ending quietly when the JVM hung up.

    A broken or reset connection means the JVM closed the socket: the task is over and its
    failure, if any, is the JVM's to report. Any other error still reaches PySpark's daemon.
    """

    def run(sock: Any, authenticated: bool) -> int:
        try:
            return worker(sock, authenticated)
        except (BrokenPipeError, ConnectionResetError):
            return 1

    return run


def main() -> None:
    """Set up the daemon process (see the module docstring), then run PySpark's daemon."""
    kept = prefer_installed(sys.path)
    drop_from_path(tuple(p for p in sys.path if p not in kept))
    warm_up()
    import pyspark.daemon

    gc.collect()
    gc.freeze()  # see the module docstring: workers' collections skip what was imported

    pyspark.daemon.worker = quiet_when_hung_up(pyspark.daemon.worker)
    pyspark.daemon.manager()


if __name__ == "__main__":
    main()

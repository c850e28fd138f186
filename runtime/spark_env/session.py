"""The SparkSession Onceflow runs on, with settings its exactly-once design depends on.

Adaptive query execution is switched off: it may coalesce shuffle partitions, and the runtime
relies on a record's partition being a pure function of its key (backups and keyed state are
stored per partition). Speculative execution is switched off (and refused): a speculative
copy of a task would write to sinks beside the original. Python workers are reused so
per-worker caches (Kafka clients, Bloom filters) survive from task to task.

On a local master the JVM talks to its Python workers over Unix domain sockets in a folder
only this user can enter (:func:`private_socket_dir`), not over loopback TCP: measured, every
Python stage of a task lost ~40 ms over TCP waiting for a delayed acknowledgement of the
Arrow stream, a third of a small micro-batch. Cluster masters keep TCP (the folder would have
to exist on every worker machine); ``extra_conf`` can set either way.

Spark's JVM logs go to a file (:func:`log_file`), not the terminal, and so do Onceflow's own
(the ``onceflow`` Python logger), at one level (``log_level``: error, warn, info, debug or
trace; warn by default): a failed run prints one line saying what failed and where that file
is. The JVM's standard error reaches the terminal through a filter that holds back its
shutdown noise (:mod:`~.jvm_stderr`). Spark's web UI is off unless
``spark.ui.enabled=true`` is passed in ``extra_conf``; its address is then printed.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from onceflow.kernel.errors import ConfigError
from onceflow.kernel.limits import ARROW_BATCH_BYTES, ARROW_BATCH_ROWS
from onceflow.runtime.spark_env.jvm import FAST_JVM, driver_options, spark_home_without_zips
from onceflow.runtime.spark_env.jvm_stderr import filtered_stderr

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

REQUIRED_SQL_CONF = {
    "spark.sql.adaptive.enabled": "false",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
}
SPECULATION = "spark.speculation"
LOG4J_CONFIG = os.path.join(os.path.dirname(__file__), "log4j2.properties")
log = logging.getLogger(__name__)
LOG_FILE_PROPERTY = "onceflow.log.file"
LOG_LEVEL_PROPERTY = "onceflow.log.level"
DEFAULT_MASTER = "local[2]"  # the one default Spark master of every entry point
DEFAULT_LOG_LEVEL = "warn"
LOG_LEVELS = ("error", "warn", "info", "debug", "trace")
_PYTHON_LEVELS = {
    "error": logging.ERROR,
    "warn": logging.WARNING,
    "info": logging.INFO,
    "debug": logging.DEBUG,
    "trace": logging.DEBUG,
}
UI_CONF = "spark.ui.enabled"
# Python workers start from a warm daemon (see onceflow.runtime.spark_env.worker_daemon).
DAEMON_CONF = "spark.python.daemon.module"
DAEMON_MODULE = "onceflow.runtime.spark_env.worker_daemon"
# JVM <-> Python workers over Unix domain sockets (local masters, see the module docstring).
UDS_CONF = "spark.python.unix.domain.socket.enabled"
UDS_DIR_CONF = "spark.python.unix.domain.socket.dir"
# A socket path holds at most 107 bytes; Spark names each socket ".<uuid>.sock" (42).
MAX_SOCKET_DIR = 60

_log_file: str | None = None


def log_file() -> str | None:
    """Where the JVM of this process's session writes its log (None before a session)."""
    return _log_file


def default_log_file(app_name: str, folder: str | None = None) -> str:
    """A new log file: ``<folder>/logs/<app>-<time>-<pid>.log`` (a temp folder by default)."""
    base = (
        os.path.join(folder, "logs")
        if folder
        else os.path.join(tempfile.gettempdir(), "onceflow-logs")
    )
    os.makedirs(base, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.abspath(os.path.join(base, f"{app_name}-{stamp}-{os.getpid()}.log"))


def spark_session(
    master: str = DEFAULT_MASTER,
    *,
    app_name: str = "onceflow",
    parallelism: int = 2,
    extra_conf: dict[str, str] | None = None,
    log_path: str | None = None,
    log_level: str = DEFAULT_LOG_LEVEL,
) -> SparkSession:
    """Get or create the session (local mode by default, any ``--master`` URL works)."""
    global _log_file  # noqa: PLW0603 - one JVM, one log file per process
    if log_level not in LOG_LEVELS:
        msg = f"log level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}"
        raise ConfigError(msg)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if "SPARK_HOME" not in os.environ:
        home = spark_home_without_zips()
        if home is not None:
            os.environ["SPARK_HOME"] = home
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        _check_jars(active, (extra_conf or {}).get("spark.jars", ""))
        adopt(active)
        return active
    path = log_path or default_log_file(app_name)
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config(UI_CONF, "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(parallelism))
        .config("spark.default.parallelism", str(parallelism))
        .config("spark.python.worker.reuse", "true")
        .config(DAEMON_CONF, DAEMON_MODULE)
        .config(SPECULATION, "false")
        .config("spark.driver.extraJavaOptions", _driver_java_options(path, log_level))
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(ARROW_BATCH_ROWS))
        .config("spark.sql.execution.arrow.maxBytesPerBatch", str(ARROW_BATCH_BYTES))
    )
    from onceflow.runtime.faults import executor_conf

    defaults = {**REQUIRED_SQL_CONF, **local_socket_conf(master), **executor_conf()}
    for key, value in {**defaults, **(extra_conf or {})}.items():
        builder = builder.config(key, value)
    importing = import_beside_the_jvm()
    try:
        with filtered_stderr(path), jvm_in_its_own_group():
            session = builder.getOrCreate()
    finally:
        importing.join()  # done by then when the session started; else not cut off mid-import
    _log_file = path
    logging.getLogger("py4j").setLevel(logging.ERROR)
    python_logging(path, log_level)
    adopt(session)
    if (extra_conf or {}).get(UI_CONF, "false").lower() == "true":
        print(f"Spark UI: {session.sparkContext.uiWebUrl}", file=sys.stderr, flush=True)
    if log_level != DEFAULT_LOG_LEVEL:
        print(f"log ({log_level}): {path}", file=sys.stderr, flush=True)
    return session


@contextlib.contextmanager
def jvm_in_its_own_group() -> Iterator[None]:
    """Start Spark's driver JVM in a process group of its own (same session).

    A SIGTERM to the run's process group (a container stop, ``kill -TERM -PGID``) then reaches
    the ``onceflow`` process only, which finishes the micro-batch under way and stops; the
    JVM would otherwise die mid-batch under it and a page of tracebacks follow. A kill of the
    whole session (the crash tests' SIGKILL) still reaches it, and it exits when its parent
    does (PySpark's gateway watches its standard input).
    """
    from pyspark.core import context

    names = vars(context)  # PySpark's module, whose launcher its SparkContext calls
    launch = names["launch_gateway"]

    def own_group(conf: object = None, popen_kwargs: dict[str, object] | None = None) -> object:
        return launch(conf, {**(popen_kwargs or {}), "process_group": 0})

    names["launch_gateway"] = own_group
    try:
        yield
    finally:
        names["launch_gateway"] = launch


# Third-party modules PySpark's driver imports while its session starts (none imports PySpark).
BESIDE_THE_JVM = ("numpy", "pyarrow", "pandas")


def import_beside_the_jvm(modules: tuple[str, ...] = BESIDE_THE_JVM) -> threading.Thread:
    """Import ``modules`` in a thread while the JVM starts (the main thread waits for it).

    PySpark's first call into the JVM with arguments asks its numpy converter whether it
    applies, which imports ``pyspark.testing.utils``, which imports numpy, pandas and pyarrow
    to see if they are there: measured with cProfile, 1.7-1.9 s of a 5-7 s session start on
    a loaded machine, in the main thread, after the JVM was up. Here they are imported while
    the main thread sleeps waiting for the JVM to listen. Only libraries that never import
    PySpark are imported in the thread, so it can not wait for a module the main thread is
    importing while that one waits for it (two threads importing one module take turns).
    """

    def run() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - PySpark imports it later, and reports
                log.debug("importing %s beside the JVM failed", name, exc_info=True)

    thread = threading.Thread(target=run, name="onceflow-imports", daemon=True)
    thread.start()
    return thread


def local_socket_conf(master: str) -> dict[str, str]:
    """Unix domain sockets between the JVM and its Python workers, for a local master."""
    if not master.startswith("local"):
        return {}
    return {UDS_CONF: "true", UDS_DIR_CONF: private_socket_dir()}


def private_socket_dir() -> str:
    """A folder for the workers' sockets that only this user can enter (made if need be).

    Spark's Unix sockets carry no secret (a TCP one does): the folder's mode is what keeps
    other local users out, so one that is not this user's own with mode 0700 is not used.
    """
    base = os.path.join(tempfile.gettempdir(), f"onceflow-sockets-{os.getuid()}")
    if len(base) <= MAX_SOCKET_DIR:
        try:
            os.mkdir(base, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(base)
        if os.path.isdir(base) and not os.path.islink(base):
            if st.st_uid == os.getuid() and st.st_mode & 0o077 == 0:
                sweep_sockets(base)
                return base
    return tempfile.mkdtemp(prefix="onceflow-sockets-", dir="/tmp")


def sweep_sockets(folder: str) -> int:
    """Remove sockets nobody listens on any more (a killed run's); return how many.

    A socket some process still has bound (another run's) is listed in ``/proc/net/unix``
    and stays; where that cannot be read, nothing is removed.
    """
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as fh:
            bound = {line.split()[-1] for line in fh if line.rstrip().endswith(".sock")}
    except OSError:
        return 0
    gone = 0
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.endswith(".sock") and path not in bound:
            with contextlib.suppress(OSError):
                os.unlink(path)
                gone += 1
    return gone


def python_logging(path: str, level: str) -> None:
    """Send the ``onceflow`` logger to the session's log file, at ``level``."""
    logger = logging.getLogger("onceflow")
    logger.setLevel(_PYTHON_LEVELS[level])
    for handler in list(logger.handlers):
        if getattr(handler, "onceflow_log", False):
            logger.removeHandler(handler)
            handler.close()
    handler = logging.FileHandler(path)
    handler.setFormatter(
        logging.Formatter(
            "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"
        )
    )
    handler.onceflow_log = True  # type: ignore[attr-defined]
    logger.addHandler(handler)


def _check_jars(session: SparkSession, wanted: str) -> None:
    """Jars load only when a session starts: refuse a running one that lacks some."""
    loaded = set(session.sparkContext.getConf().get("spark.jars", "").split(","))
    missing = [j for j in wanted.split(",") if j and j not in loaded]
    if missing:
        msg = (
            f"this process's SparkSession started without {missing}: jars load only when a "
            "session starts; stop it (spark.stop()) or start it with spark.jars including them"
        )
        raise ConfigError(msg)


def _driver_java_options(path: str, level: str) -> str:
    archive = driver_options()  # faster start (see onceflow.runtime.spark_env.jvm)
    return (
        f"{FAST_JVM} {archive} -Dlog4j2.configurationFile=file:{LOG4J_CONFIG} "
        f"-D{LOG_FILE_PROPERTY}={path} -D{LOG_LEVEL_PROPERTY}={level}"
    ).replace("  ", " ")


def adopt(session: SparkSession) -> None:
    """Apply the settings Onceflow needs to a session someone else created."""
    for key, value in REQUIRED_SQL_CONF.items():
        session.conf.set(key, value)
    if session.sparkContext.getConf().get(SPECULATION, "false").lower() == "true":
        msg = (
            "spark.speculation is true: a speculative copy of a task would write to sinks "
            "beside the original. Set spark.speculation=false for Onceflow pipelines"
        )
        raise ConfigError(msg)


# "0" switches the warm-up of Python workers off (see warm_workers); its Spark job's group.
WARM_WORKERS_ENV = "ONCEFLOW_WARM_WORKERS"
WARM_WORKERS_GROUP = "onceflow-warm-workers"


def _pass_through(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    yield from batches


def warm_workers(session: SparkSession, partitions: int) -> threading.Thread | None:
    """Start Spark's Python worker daemon and ``partitions`` workers now, in the background.

    A run's first micro-batch otherwise waits for them: the daemon starts and imports what the
    workers need (~1-1.5 s, see :mod:`~.worker_daemon`). A tiny job on another
    thread starts them while the driver reads its checkpoint, prepares connectors and starts
    the query (~2-3 s of its own); the workers are then reused by the first batch's tasks.
    Only an optimisation: a failure is logged and ignored (``ONCEFLOW_WARM_WORKERS=0``
    switches it off).
    """
    if os.environ.get(WARM_WORKERS_ENV, "1") == "0":
        return None

    def run() -> None:
        try:
            if os.environ.get("PYSPARK_PIN_THREAD", "true").lower() != "false":
                # (unpinned, a thread's job group would reach other threads' jobs)
                session.sparkContext.setJobGroup(WARM_WORKERS_GROUP, "start the Python workers")
            frame = session.range(0, partitions, 1, partitions)
            frame.mapInArrow(_pass_through, "id long").collect()
        except Exception:  # noqa: BLE001 - the run goes on without it
            log.debug("warming up the Python workers failed", exc_info=True)

    thread = threading.Thread(target=run, name="onceflow-warm-workers", daemon=True)
    thread.start()
    return thread


def prime_data_sources(session: SparkSession) -> threading.Thread:
    """Have Spark look up the installed Python data sources now, in the background.

    Spark does it once per JVM, the first time a Python data source is registered or named:
    it starts a Python interpreter (under a daemon of its own) that lists every module on the
    path for ``pyspark_*`` packages. A run reading one (a Kafka source) waited for that in its
    first ``format(...).load()``, after preparing the checkpoint and connectors (measured on
    a restart, 2 cores under load: 1.5-3 s from Spark's "Loading static Python Data Sources"
    to the next Python process); from here it overlaps that preparation. The run's own
    registration waits for the lookup if it is still going (Spark holds a lock). Only an
    optimisation: a failure is logged and ignored.
    """

    def run() -> None:
        try:
            manager = session._jsparkSession.sessionState().dataSourceManager()  # noqa: SLF001
            manager.dataSourceExists("onceflow")
        except Exception:  # noqa: BLE001 - the run goes on without it
            log.debug("looking up the Python data sources early failed", exc_info=True)

    thread = threading.Thread(target=run, name="onceflow-data-sources", daemon=True)
    thread.start()
    return thread

"""How the Spark driver's JVM is launched: its options, its class-data archive, SPARK_HOME.

Everything here is a start-up cost measured on a 2-core machine (see the functions). The
archive itself is made by :mod:`~.jvm_archive`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

# Fast JVM start (~half the session start time).
FAST_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
VERSION = "1"  # of the warm-up workload: a new one makes a new archive
CACHE_ENV = "ONCEFLOW_CACHE_DIR"
DISABLE_ENV = "ONCEFLOW_JVM_ARCHIVE"  # "0": never use or build one
DUMP_ENV = "ONCEFLOW_JVM_ARCHIVE_DUMP"  # set in the warm-up child: where its JVM writes one
# Silence the JVM's notes about an archive it cannot use (another Java, another classpath).
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"


def cache_dir() -> str:
    """Where Onceflow keeps what it builds once per machine (``~/.cache/onceflow``)."""
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "onceflow",
    )
    return os.path.join(base, "jvm")


def _java() -> str | None:
    home = os.environ.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return os.path.realpath(found) if found and os.path.exists(found) else None


def archive_key() -> str | None:
    """What the archive depends on: the Java binary, PySpark's version, jars and home.

    A reinstalled PySpark (same version, same folder, new files) makes a new key: the JVM
    would refuse the old archive and start without one, every run.
    """
    import pyspark

    java = _java()
    if java is None:
        return None
    jars = os.path.join(os.path.dirname(pyspark.__file__), "jars")
    try:  # the JVM refuses an archive, silently here, once a jar's time or size changed
        listing = [_stamp(os.path.join(jars, name)) for name in sorted(os.listdir(jars))]
    except OSError:
        return None
    # the classpath names the jars through SPARK_HOME: the archive is only valid for it
    home = os.environ.get("SPARK_HOME") or spark_home_without_zips() or jars
    parts = [VERSION, java, str(os.stat(java).st_mtime_ns), pyspark.__version__, home, FAST_JVM]
    digest = hashlib.sha256("\0".join([*parts, *listing]).encode()).hexdigest()
    return digest[:16]


def _stamp(path: str) -> str:
    """A jar as the JVM checks it against an archive: name, modification time and size."""
    st = os.stat(path)
    return f"{os.path.basename(path)}:{st.st_mtime_ns}:{st.st_size}"


def archive_path() -> str | None:
    """The archive for this Java and PySpark (it may not exist yet); None if unknown."""
    if os.environ.get(DISABLE_ENV) == "0":
        return None
    key = archive_key()
    return None if key is None else os.path.join(cache_dir(), f"spark-driver-{key}.jsa")


def driver_options() -> str:
    """Java options that use the archive when it exists ('' otherwise).

    In the warm-up child, the options that write it instead.
    """
    dump = os.environ.get(DUMP_ENV)
    if dump:
        return f"-XX:ArchiveClassesAtExit={dump} {QUIET}"
    path = archive_path()
    if path is None or not os.path.isfile(path):
        return ""
    return f"-XX:SharedArchiveFile={path} {QUIET}"


def spark_home_without_zips() -> str | None:
    """A ``SPARK_HOME`` for a pip-installed PySpark whose Python processes import it compiled.

    The JVM puts ``$SPARK_HOME/python/lib/pyspark.zip`` (and py4j's zip) first on the path of
    every Python process it starts. Modules imported from a zip are compiled from source in
    each new process (no bytecode cache can be written into it): measured, 0.5 s instead of
    0.1 s to start each of the processes a streaming run needs before its first micro-batch
    (the data source lookup, creation and planning, the streaming source runner; the UDF
    workers' daemon drops the zips itself, :mod:`~.worker_daemon`). When PySpark
    is installed as a package, the very same modules are installed beside Onceflow: this folder
    (made once under the cache folder) links PySpark's ``bin``, ``jars``, ``sbin`` and ``conf``
    and has no ``python/lib``, so those processes import the installed, compiled package. None
    (keep PySpark's own) when PySpark is not a pip install; a ``SPARK_HOME`` the user set is
    never replaced (see :func:`spark_session`).
    """
    import pyspark

    source = os.path.dirname(os.path.realpath(pyspark.__file__))
    parts = ("bin", "jars", "sbin", "conf")
    if not all(os.path.isdir(os.path.join(source, p)) for p in ("bin", "jars")):
        return None
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    home = os.path.join(os.path.dirname(cache_dir()), f"spark-home-{pyspark.__version__}-{digest}")
    if os.path.isdir(home):
        return home
    os.makedirs(os.path.dirname(home), exist_ok=True)
    building = tempfile.mkdtemp(prefix=".spark-home-", dir=os.path.dirname(home))
    for part in parts:
        if os.path.isdir(os.path.join(source, part)):
            os.symlink(os.path.join(source, part), os.path.join(building, part))
    try:
        os.rename(building, home)
    except OSError:  # another process made it first
        shutil.rmtree(building, ignore_errors=True)
    return home

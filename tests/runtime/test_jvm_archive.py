"""The driver JVM's class-data archive: made once, then mapped by every driver that starts."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from onceflow.runtime.spark_env import jvm, jvm_archive

CHILD = """
from onceflow.runtime.spark_env.session import spark_session
spark = spark_session("local[1]", app_name="cds-check")
spark.range(3).collect()
spark.stop()
"""


def test_without_an_archive_no_option_is_added(tmp_path, monkeypatch):
    monkeypatch.setenv(jvm.CACHE_ENV, str(tmp_path))
    assert jvm.driver_options() == ""
    monkeypatch.setenv(jvm.DISABLE_ENV, "0")
    assert jvm.archive_path() is None


def test_a_jar_with_a_new_time_gets_a_new_archive(tmp_path, monkeypatch):
    """A reinstall rewrites the jars: the JVM would refuse the archive made for the old ones."""
    import pyspark

    package = tmp_path / "pyspark"
    (package / "jars").mkdir(parents=True)
    jar = package / "jars" / "spark-core.jar"
    jar.write_bytes(b"jar")
    monkeypatch.setattr(pyspark, "__file__", str(package / "__init__.py"))
    monkeypatch.setenv("SPARK_HOME", str(package))
    before = jvm.archive_key()
    assert before is not None, "no java here"
    st = jar.stat()
    os.utime(jar, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert jvm.archive_key() != before
    os.utime(jar, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert jvm.archive_key() == before


@pytest.mark.spark
def test_a_driver_maps_the_archive_it_finds(tmp_path):
    """The machine's own archive: ``./quickstart.sh`` builds it (~20-30 s), or this does."""
    env = dict(os.environ)
    env.pop(jvm.DISABLE_ENV, None)
    made = subprocess.run(
        [sys.executable, "-m", jvm_archive.MODULE],
        env=env,
        capture_output=True,
        text=True,
        timeout=jvm_archive.BUILD_TIMEOUT_S,
        check=True,
    )
    path = made.stdout.strip()
    assert path.startswith(jvm.cache_dir()) and os.path.getsize(path) > 10_000_000
    made_at = os.stat(path).st_mtime_ns
    again = subprocess.run(  # safe to run twice: the archive is kept
        [sys.executable, "-m", jvm_archive.MODULE],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert again.stdout.strip() == path and os.stat(path).st_mtime_ns == made_at

    logs = tmp_path / "classes"
    logs.mkdir()
    # every JVM of the child logs where its classes came from (%p: one file per JVM)
    env["JAVA_TOOL_OPTIONS"] = f"-Xlog:class+load=info:file={logs}/jvm-%p.txt"
    subprocess.run([sys.executable, "-c", CHILD], env=env, timeout=300, check=True)
    shared = 0
    for log in glob.glob(str(logs / "jvm-*.txt")):
        with open(log, errors="replace") as fh:
            shared += sum("shared objects file (top)" in line for line in fh)
    assert shared > 1000, "the driver loaded its classes from the jars, not the archive"

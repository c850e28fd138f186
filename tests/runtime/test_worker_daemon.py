"""The warm worker daemon: what Spark's Python workers import from, and what they hold."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from onceflow.runtime.spark_env import worker_daemon
from onceflow.runtime.spark_env.worker_daemon import drop_from_path, prefer_installed


def _package(folder, name: str, version: str) -> None:
    pkg = folder / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "version.py").write_text(f'__version__: str = "{version}"\n')


def _zip(path, name: str, version: str) -> str:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}/__init__.py", "")
        zf.writestr(f"{name}/version.py", f'__version__ = "{version}"\n')
    return str(path)


def test_a_zip_of_the_installed_version_goes_and_another_version_stays(tmp_path):
    site = tmp_path / "site"
    _package(site, "pyspark", "4.3.0")
    _package(site, "py4j", "0.10.9.9")
    same = _zip(tmp_path / "pyspark.zip", "pyspark", "4.3.0")
    other = _zip(tmp_path / "py4j-0.10.9.7-src.zip", "py4j", "0.10.9.7")
    path = [same, other, str(site)]
    assert prefer_installed(path) == [other, str(site)]


def test_a_zip_stays_when_nothing_else_provides_its_package(tmp_path):
    lone = _zip(tmp_path / "pyspark.zip", "pyspark", "4.3.0")
    assert prefer_installed([lone, str(tmp_path / "empty")]) == [lone, str(tmp_path / "empty")]


def test_a_jar_without_python_goes_and_one_with_python_stays(tmp_path):
    plain = tmp_path / "spark-core.jar"
    with zipfile.ZipFile(plain, "w") as zf:
        zf.writestr("org/apache/spark/SparkContext.class", b"\xca\xfe")
    with_python = tmp_path / "assembly.jar"
    with zipfile.ZipFile(with_python, "w") as zf:
        zf.writestr("pyspark/__init__.py", "")
    assert prefer_installed([str(plain), str(with_python)]) == [str(with_python)]


def test_dropping_a_path_forgets_its_importers_and_namespace_packages(tmp_path, monkeypatch):
    jar = tmp_path / "core.jar"
    with zipfile.ZipFile(jar, "w") as zf:
        for folder in ("orgx/", "orgx/apache/"):  # jars list their folders, as Spark's do
            zf.writestr(folder, b"")
        zf.writestr("orgx/apache/Thing.class", b"\xca\xfe")
    monkeypatch.setattr(sys, "path", [str(jar), *sys.path])
    monkeypatch.setattr(sys, "path_importer_cache", dict(sys.path_importer_cache))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    import importlib

    importlib.invalidate_caches()
    namespace = importlib.import_module("orgx")  # a namespace package found in the jar
    assert list(namespace.__path__) == [os.path.join(str(jar), "orgx")]
    assert any(p.startswith(str(jar)) for p in sys.path_importer_cache)

    drop_from_path((str(jar),))

    assert str(jar) not in sys.path
    assert not any(p.startswith(str(jar)) for p in sys.path_importer_cache)
    assert "orgx" not in sys.modules


def test_preloading_starts_no_thread_in_a_fresh_interpreter():
    """The daemon forks workers after preloading: that is only safe single-threaded."""
    code = (
        "import os\n"
        "for k, v in {'JE_ARROW_MALLOC_CONF': 'background_thread:false',"
        " 'OPENBLAS_NUM_THREADS': '1'}.items(): os.environ.setdefault(k, v)\n"
        "from onceflow.runtime.spark_env import worker_daemon as w\n"
        "done = w.preload()\n"
        "print(w.threads(), len(done))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in worker_daemon.SINGLE_THREAD_ENV}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    threads, modules = out.stdout.split()
    assert threads == "1"
    assert int(modules) >= len(worker_daemon.PRELOAD) - len(worker_daemon.OPTIONAL)


def _what_a_worker_sees(batches):
    import gc
    import zipfile as _zf  # noqa: F401 - the worker's own import
    import zipimport

    import pyarrow as pa
    import pyspark

    spark_zips = [  # user code shipped as a zip (addPyFile) is not Spark's to drop
        k
        for k, v in sys.path_importer_cache.items()
        if isinstance(v, zipimport.zipimporter)
        and os.path.basename(k).startswith(("pyspark", "py4j", "spark-core"))
    ]
    for _ in batches:
        yield pa.RecordBatch.from_pydict(
            {
                "pid": [os.getpid()],
                "pyspark": [pyspark.__file__],
                "importers": [len(spark_zips)],
                "preloaded": ["onceflow.dedup.guard" in sys.modules],
                "frozen": [gc.get_freeze_count()],
            }
        )


@pytest.mark.spark
def test_workers_import_the_installed_pyspark_and_start_preloaded(spark):
    assert spark.conf.get("spark.python.daemon.module") == worker_daemon.MODULE
    rows = (
        spark.range(0, 100, numPartitions=2)
        .mapInArrow(
            _what_a_worker_sees,
            "pid long, pyspark string, importers long, preloaded boolean, frozen long",
        )
        .collect()
    )
    assert rows
    for row in rows:
        assert ".zip" not in row["pyspark"], "pyspark came from Spark's zip, compiled anew"
        assert row["importers"] == 0, "a zip of Spark's is left for invalidate_caches to re-read"
        assert row["preloaded"], "the worker started without the daemon's preloaded modules"
        # PySpark collects after every task: the imported objects must not be walked again
        assert row["frozen"] > 50_000, "the daemon forked without freezing what it imported"


def test_a_worker_whose_jvm_hung_up_ends_quietly_and_other_errors_still_raise():
    import socket

    def flushes_to(sock, authenticated):
        for _ in range(1000):
            sock.sendall(b"x" * 65536)
        return 0

    def fails(sock, authenticated):
        raise ValueError("a real bug")

    ours, jvm = socket.socketpair()
    jvm.close()  # the JVM gave up on the task
    try:
        with pytest.raises(BrokenPipeError):
            flushes_to(ours, True)
        assert worker_daemon.quiet_when_hung_up(flushes_to)(ours, True) == 1
        with pytest.raises(ValueError, match="a real bug"):
            worker_daemon.quiet_when_hung_up(fails)(ours, True)
    finally:
        ours.close()

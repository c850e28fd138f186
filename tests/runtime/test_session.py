"""The session's settings that are Onceflow's own choice: sockets to the Python workers."""

from __future__ import annotations

import os
import socket
import stat

import pytest

from onceflow.runtime.spark_env import session
from onceflow.runtime.spark_env.session import (
    UDS_CONF,
    UDS_DIR_CONF,
    local_socket_conf,
    private_socket_dir,
    sweep_sockets,
)


def test_local_masters_talk_to_workers_over_unix_sockets_in_a_private_folder():
    conf = local_socket_conf("local[2]")
    assert conf[UDS_CONF] == "true"
    mode = os.stat(conf[UDS_DIR_CONF]).st_mode
    assert stat.S_IMODE(mode) == 0o700, "Spark's Unix sockets carry no secret"
    assert len(conf[UDS_DIR_CONF]) + 42 < 108, "room for Spark's socket names"
    assert local_socket_conf("spark://host:7077") == {}, "the folder may not exist on workers"


def test_a_shared_folder_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setattr(session.tempfile, "gettempdir", lambda: str(tmp_path))
    open_to_all = tmp_path / f"onceflow-sockets-{os.getuid()}"
    open_to_all.mkdir(mode=0o777)
    open_to_all.chmod(0o777)
    chosen = private_socket_dir()
    assert chosen != str(open_to_all)
    assert stat.S_IMODE(os.stat(chosen).st_mode) == 0o700


def test_sockets_of_killed_runs_are_swept_and_live_ones_kept(tmp_path):
    if not os.path.exists("/proc/net/unix"):
        pytest.skip("needs Linux's /proc/net/unix")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(tmp_path / ".live.sock"))
    live.listen(1)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(tmp_path / ".dead.sock"))
    dead.close()  # the file stays, as after a kill -9
    (tmp_path / "notes.txt").write_text("not a socket of ours")
    try:
        assert sweep_sockets(str(tmp_path)) == 1
        assert sorted(os.listdir(tmp_path)) == [".live.sock", "notes.txt"]
    finally:
        live.close()


class _WhereIsPyspark:
    """A data source whose schema names where its planning process imported PySpark from."""

    @staticmethod
    def make() -> type:
        from pyspark.sql.datasource import DataSource

        class WhereIsPyspark(DataSource):
            @classmethod
            def name(cls) -> str:
                return "onceflow_where_is_pyspark"

            def schema(self) -> str:
                import pyspark

                return "from_zip int" if ".zip" in pyspark.__file__ else "installed int"

        return WhereIsPyspark


@pytest.mark.spark
def test_spark_s_planning_processes_import_the_installed_pyspark(spark):
    """Not pyspark.zip, which every new process would compile from source (~0.4 s each)."""
    if os.environ.get("SPARK_HOME") != session.spark_home_without_zips():
        pytest.skip("SPARK_HOME was set outside Onceflow: its zips are used as it says")
    spark.dataSource.register(_WhereIsPyspark.make())
    assert spark.read.format("onceflow_where_is_pyspark").load().columns == ["installed"]
    home = os.environ["SPARK_HOME"]
    assert os.path.isdir(os.path.join(home, "jars")) and not os.path.exists(
        os.path.join(home, "python")
    )


def test_python_workers_are_warmed_by_a_job_of_their_own(spark, monkeypatch):
    monkeypatch.setenv(session.WARM_WORKERS_ENV, "0")
    assert session.warm_workers(spark, 2) is None
    monkeypatch.delenv(session.WARM_WORKERS_ENV)
    thread = session.warm_workers(spark, 2)
    assert thread is not None
    thread.join(timeout=120)
    assert not thread.is_alive()
    tracker = spark.sparkContext.statusTracker()
    jobs = [tracker.getJobInfo(j) for j in tracker.getJobIdsForGroup(session.WARM_WORKERS_GROUP)]
    assert jobs, "the warm-up ran a job"
    assert all(j is not None and j.status == "SUCCEEDED" for j in jobs)

"""Where a query's checkpoint is, read through Hadoop's FileSystem, and runs from elsewhere.

The default checkpoint ``<output-dir>/<pipeline>/checkpoint`` is resolved against the folder
a run starts from. A run started from another folder finds an empty checkpoint beside an
old namespace: it is refused, saying why, instead of re-reading input over the old state.
"""

from __future__ import annotations

import os
import uuid
from types import SimpleNamespace

import pytest

from onceflow.backup.store import acknowledge
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.keyspace import Keyspace
from onceflow.runtime.driver.checkpoint import IDENTITY_FILE, Checkpoint
from onceflow.runtime.driver.pinning import check_not_behind, pin_checkpoint
from onceflow.runtime.driver.startup import checkpoint_location


def test_a_relative_location_is_made_absolute_against_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert checkpoint_location(None, "out", "p") == str(tmp_path / "out" / "p" / "checkpoint")
    assert checkpoint_location("ckpt", "out", "p") == str(tmp_path / "ckpt")


@pytest.mark.parametrize("url", ["file:///data/ckpt", "hdfs://nn:8020/ckpt", "s3a://b/ckpt"])
def test_a_url_is_kept_as_given(url):
    assert checkpoint_location(url, "out", "p") == url


@pytest.mark.spark
def test_a_file_url_checkpoint_is_read_and_written_through_hadoop(spark, tmp_path):
    folder = tmp_path / "ckpt"
    (folder / "offsets").mkdir(parents=True)
    (folder / "commits").mkdir()
    (folder / "offsets" / "0").write_text('v1\n{"batchWatermarkMs":0}\n{"t:0":5}\n')
    (folder / "commits" / "0").write_text("v1\n{}\n")
    cp = Checkpoint(spark, f"file://{folder}")
    assert cp.has_progress() and cp.last_committed() == 0
    assert cp.end_offsets(0) == [{"t:0": 5}]
    cp.write("abc\n", IDENTITY_FILE)
    assert cp.identity() == "abc"
    assert (folder / IDENTITY_FILE).read_text() == "abc\n", "written where the URL points"


@pytest.mark.spark
@pytest.mark.redis
def test_a_run_from_another_folder_is_refused_with_the_reason(
    spark, redis_server, tmp_path, monkeypatch
):
    client = redis_server.client()
    keyspace = Keyspace(f"p-{uuid.uuid4().hex[:8]}")
    first, other = tmp_path / "first", tmp_path / "other"
    first.mkdir()
    other.mkdir()

    def default_checkpoint() -> Checkpoint:
        return Checkpoint(spark, checkpoint_location(None, "onceflow-output", "p"))

    monkeypatch.chdir(first)
    identity = pin_checkpoint(client, keyspace, default_checkpoint())
    client.hset(keyspace.meta, "parallelism", "2")  # the run left state behind
    monkeypatch.chdir(other)
    with pytest.raises(ConfigError, match="another folder") as refused:
        pin_checkpoint(client, keyspace, default_checkpoint())
    assert str(first / "onceflow-output") in str(refused.value)  # names the run to resume
    assert not os.path.exists(other / "onceflow-output" / "p" / "checkpoint" / IDENTITY_FILE)
    monkeypatch.chdir(first)
    assert pin_checkpoint(client, keyspace, default_checkpoint()) == identity


@pytest.mark.spark
def test_a_local_checkpoint_is_written_without_forking_chmod(spark, tmp_path):
    """FileContext forks `chmod` per file without Hadoop's native library; FileSystem less."""
    from onceflow.runtime.driver.checkpoint import LOCAL_MANAGER, MANAGER_CONF, choose_manager

    try:
        choose_manager(spark, Checkpoint(spark, str(tmp_path / "ckpt")), {})
        assert spark.conf.get(MANAGER_CONF) == LOCAL_MANAGER
        elsewhere = SimpleNamespace(local=False)  # HDFS, an object store: Spark's default
        choose_manager(spark, elsewhere, {})  # type: ignore[arg-type]
        assert spark.conf.get(MANAGER_CONF, None) is None, "a shared store keeps Spark's own"
        choose_manager(spark, Checkpoint(spark, str(tmp_path / "c2")), {MANAGER_CONF: "x.Mine"})
        assert spark.conf.get(MANAGER_CONF, None) is None, "the user's choice is left alone"
        spark.conf.set(MANAGER_CONF, "x.SetOnTheSession")
        choose_manager(spark, Checkpoint(spark, str(tmp_path / "c3")), {})
        assert spark.conf.get(MANAGER_CONF) == "x.SetOnTheSession"
    finally:
        spark.conf.unset(MANAGER_CONF)


@pytest.mark.spark
@pytest.mark.redis
def test_a_checkpoint_behind_the_batches_redis_acknowledged_is_refused(
    spark, redis_server, tmp_path
):
    """Backups of acknowledged batches are garbage: a checkpoint that lost its last commits
    would replay batches without them (a copy restored from before, a folder losing writes)."""
    client = redis_server.client()
    keyspace = Keyspace(f"p-{uuid.uuid4().hex[:8]}")
    folder = tmp_path / "ckpt"
    (folder / "offsets").mkdir(parents=True)
    (folder / "commits").mkdir()
    cp = Checkpoint(spark, str(folder))
    check_not_behind(client, keyspace, cp)  # a new namespace acknowledged nothing
    acknowledge(client, keyspace, 0)
    with pytest.raises(ConfigError, match="has no committed micro-batch"):
        check_not_behind(client, keyspace, cp)
    for batch in range(3):
        (folder / "offsets" / str(batch)).write_text('v1\n{"batchWatermarkMs":0}\n{"t:0":5}\n')
        (folder / "commits" / str(batch)).write_text("v1\n{}\n")
    acknowledge(client, keyspace, 2)
    check_not_behind(client, keyspace, cp)
    (folder / "commits" / "2").unlink()  # Spark's commit of batch 2 is lost
    with pytest.raises(ConfigError, match="ends at micro-batch 1") as refused:
        check_not_behind(client, keyspace, cp)
    assert "onceflow reset" in str(refused.value)

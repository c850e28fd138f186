"""``onceflow run --conf KEY=VALUE``: Spark settings for the session, as spark-submit takes them."""

from __future__ import annotations

import pytest

from onceflow.cli.commands import spark_conf
from onceflow.cli.main import build_parser
from onceflow.kernel.errors import ConfigError
from onceflow.runtime.faults import executor_conf


def test_conf_pairs_reach_the_run_settings():
    args = build_parser().parse_args(
        ["run", "p.py", "--conf", "spark.executor.memory=512m", "--conf", "spark.a=b=c"]
    )
    assert spark_conf(args) == {"spark.executor.memory": "512m", "spark.a": "b=c"}


def test_a_conf_without_a_value_is_refused():
    args = build_parser().parse_args(["run", "p.py", "--conf", "spark.executor.memory"])
    with pytest.raises(ConfigError, match="key=value"):
        spark_conf(args)


def test_a_crash_request_travels_to_executors(monkeypatch):
    monkeypatch.setenv("ONCEFLOW_CRASH", "point=batch_end,batch=1")
    monkeypatch.delenv("ONCEFLOW_CRASH_FILE", raising=False)
    assert executor_conf() == {"spark.executorEnv.ONCEFLOW_CRASH": "point=batch_end,batch=1"}

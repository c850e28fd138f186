"""File connectors on a cluster: refused unless their path is shared by every machine."""

from __future__ import annotations

import pytest

from onceflow.connectors.files import JsonLinesSink, JsonLinesSource
from onceflow.kernel.errors import ConfigError
from onceflow.runtime.driver.placement import check_paths, runs_on_one_machine


@pytest.mark.parametrize(
    ("master", "local"),
    [("local[2]", True), ("local[2,4]", True), ("spark://h:7077", False), ("yarn", False)],
)
def test_which_masters_keep_tasks_on_the_driver_machine(master, local):
    assert runs_on_one_machine(master) is local


def test_a_local_sink_path_is_refused_on_a_cluster(tmp_path):
    sink = JsonLinesSink(str(tmp_path / "out.jsonl"))
    sink.prepare("p", streaming=False)
    check_paths([sink], "local[2]")
    with pytest.raises(ConfigError, match="each worker's own disk.*shared=True"):
        check_paths([sink], "spark://127.0.0.1:7077")


def test_a_local_source_path_is_refused_on_a_cluster(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"a": 1}\n')
    source = JsonLinesSource(str(tmp_path / "in.jsonl"))
    source.prepare("p", streaming=False)
    with pytest.raises(ConfigError, match="in.jsonl"):
        check_paths([source], "spark://127.0.0.1:7077")


def test_shared_paths_are_allowed(tmp_path, monkeypatch):
    (tmp_path / "in.jsonl").write_text('{"a": 1}\n')
    source = JsonLinesSource(str(tmp_path / "in.jsonl"), shared=True)
    source.prepare("p", streaming=False)
    sink = JsonLinesSink(str(tmp_path / "nfs" / "out.jsonl"))
    sink.prepare("p", streaming=False)
    monkeypatch.setenv("ONCEFLOW_SHARED_DIRS", f"/elsewhere:{tmp_path / 'nfs'}")
    check_paths([source, sink], "spark://127.0.0.1:7077")
    monkeypatch.setenv("ONCEFLOW_SHARED_DIRS", str(tmp_path / "nf"))  # a prefix, not a folder
    with pytest.raises(ConfigError):
        check_paths([sink], "spark://127.0.0.1:7077")

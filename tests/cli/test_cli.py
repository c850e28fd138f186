from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from onceflow.cli.errors import PipelineFileError
from onceflow.cli.loader import load_pipeline
from onceflow.cli.main import main

PIPELINE_FILE = textwrap.dedent("""
    from onceflow.pipeline import Pipeline, sinks, sources

    def build():
        p = Pipeline("cli-demo")
        (p.read("nums", sources.Collection([1, 2, 3, 4]))
         .map("square", lambda x: x * x)
         .key_by("parity", lambda x: x % 2)
         .combine_per_key("total", "sum")
         .write("out", sinks.JsonLines(OUT)))
        return p

    if __name__ == "__main__":
        raise SystemExit("must not run when loaded by onceflow")
""")


@pytest.fixture
def pipeline_file(tmp_path):
    path = tmp_path / "pipe.py"
    out = tmp_path / "out.jsonl"
    path.write_text(f"OUT = {str(out)!r}\n" + PIPELINE_FILE)
    return path, out


def test_loader_finds_build_and_skips_main_block(pipeline_file):
    path, _ = pipeline_file
    assert load_pipeline(str(path)).name == "cli-demo"


def test_loader_explains_a_file_without_pipeline(tmp_path):
    path = tmp_path / "empty.py"
    path.write_text("x = 1\n")
    with pytest.raises(PipelineFileError, match="defines no pipeline: add a module-level"):
        load_pipeline(str(path))


def test_loader_asks_to_choose_between_several(tmp_path):
    path = tmp_path / "two.py"
    path.write_text("from onceflow import Pipeline\na = Pipeline('a')\nb = Pipeline('b')\n")
    with pytest.raises(PipelineFileError, match="several pipelines.*--pipeline"):
        load_pipeline(str(path))
    assert load_pipeline(str(path), "b").name == "b"


def test_explain_text_shows_both_plans(pipeline_file, capsys):
    path, _ = pipeline_file
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Logical plan of 'cli-demo' (6 nodes)" in out
    assert "stage 'nums': nums -> square -> parity -> total/partial" in out
    assert "exchange total/exchange" in out


def test_explain_no_optimize_keeps_every_node_apart(pipeline_file, capsys):
    path, _ = pipeline_file
    assert main(["explain", str(path), "--no-optimize"]) == 0
    assert "Physical plan: 5 stage(s)" in capsys.readouterr().out


def test_explain_draws_svg_with_clusters(pipeline_file, tmp_path):
    path, _ = pipeline_file
    svg = tmp_path / "plan.svg"
    assert main(["explain", str(path), "--format", "svg", "-o", str(svg)]) == 0
    text = svg.read_text()
    assert text.startswith("<?xml") and "<svg" in text
    assert "stage nums" in text and "exchange total/exchange" in text


def test_explain_dot_is_stable(pipeline_file, capsys):
    path, _ = pipeline_file
    main(["explain", str(path), "--format", "dot"])
    first = capsys.readouterr().out
    main(["explain", str(path), "--format", "dot"])
    assert capsys.readouterr().out == first
    assert "subgraph cluster_physical" in first


def test_unknown_rule_is_a_usage_error(pipeline_file, capsys):
    path, _ = pipeline_file
    assert main(["explain", str(path), "--rules", "fuse_everything"]) == 2
    assert "unknown optimizer rule(s) fuse_everything" in capsys.readouterr().err


def test_missing_file_is_a_clear_error(capsys):
    assert main(["explain", "/nonexistent/pipe.py"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.spark
def test_run_prints_a_summary_and_writes_the_sink_whatever_streaming_defaults_are_exported(
    pipeline_file, spark, capsys, tmp_path, monkeypatch
):
    # docs/guide/configuration.md says to export REDIS_URL; a bounded run does not use it
    # (issue 42: every bounded pipeline refused to start). (One CLI run per test session:
    # Spark refuses a second pipeline folder under the same name.)
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("ONCEFLOW_TRIGGER_SECONDS", "5")
    path, out = pipeline_file
    code = main(["run", str(path), "--no-progress", "--output-dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    rows = sorted(json.loads(line) for line in out.read_text().splitlines())
    assert rows == [[0, 4 + 16], [1, 1 + 9]]
    assert "records in: 4" in captured.out
    assert (
        "note: $REDIS_URL, $ONCEFLOW_TRIGGER_SECONDS not used: every source of 'cli-demo' is "
        "bounded" in captured.err
    )


@pytest.mark.spark
def test_run_refuses_streaming_settings_for_bounded_pipelines(pipeline_file, spark, capsys):
    path, _ = pipeline_file
    assert main(["run", str(path), "--no-progress", "--available-now"]) == 2
    assert "only apply to streaming runs" in capsys.readouterr().err


def test_python_dash_m_onceflow_is_the_cli():
    result = subprocess.run(
        [sys.executable, "-m", "onceflow", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0
    assert "explain" in result.stdout and "run" in result.stdout


def test_a_renamed_argument_in_a_pipeline_file_is_shown(tmp_path):
    """Python hides DeprecationWarnings outside __main__: the loader shows the file's own."""
    path = tmp_path / "old_names.py"
    path.write_text(
        "from onceflow import KafkaSink, KafkaSource, Pipeline\n"
        "p = Pipeline('old-names')\n"
        "p.read('in', KafkaSource('in', bootstrap_servers='k:1', options={'client_id': 'x'}))"
        ".write('out', KafkaSink('out', bootstrap_servers='k:1'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "onceflow", "explain", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert f"{path}:3: DeprecationWarning: KafkaSource(options=...) is deprecated" in result.stderr
    assert "pass connection=... instead" in result.stderr


def test_an_error_in_the_pipeline_file_is_one_line_naming_its_line(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import os\n\nTOPIC = os.environ['NO_SUCH_VARIABLE_X']\n")
    with pytest.raises(PipelineFileError) as info:
        load_pipeline(str(path))
    said = str(info.value)
    assert said == (
        f"loading {path}:3 failed: KeyError: 'NO_SUCH_VARIABLE_X' (a name the file reads is "
        "not set: an environment variable?)"
    )

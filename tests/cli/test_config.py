"""The command line's habits: --version, config file and environment under the flags, --conf,
--log-level and --spark-ui reaching a real session."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from importlib.metadata import version

import pytest

from onceflow.cli.commands import spark_conf
from onceflow.cli.main import main, parse_args


def write(tmp_path, text, name="onceflow.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def run_args(argv, environ=None):
    return parse_args(["run", "pipe.py", *argv], environ or {})


def test_version_comes_from_the_installed_distribution(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"onceflow {version('onceflow')}"


def test_defaults_without_file_or_environment():
    args = run_args([])
    assert (args.master, args.parallelism, args.log_level, args.metrics_port) == (
        "local[2]",
        2,
        "warn",
        None,
    )


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        ([], {}, "local[3]"),  # the file's top level
        ([], {"ONCEFLOW_MASTER": "local[4]"}, "local[4]"),  # environment over file
        (["--master", "local[5]"], {"ONCEFLOW_MASTER": "local[4]"}, "local[5]"),  # flag first
    ],
)
def test_precedence_flags_then_environment_then_file(tmp_path, argv, environ, expected):
    path = write(tmp_path, 'master = "local[3]"\n')
    args = run_args(["--config", path, *argv], environ)
    assert args.master == expected


def test_a_command_table_wins_over_the_top_level(tmp_path):
    path = write(
        tmp_path,
        """
        parallelism = 3
        metrics-port = 9100
        every = "5m"            # a gc option: ignored by run
        [run]
        parallelism = 4
        no-progress = true
        log_level = "info"
        """,
    )
    args = run_args(["--config", path])
    assert (args.parallelism, args.metrics_port, args.no_progress, args.log_level) == (
        4,
        9100,
        True,
        "info",
    )
    gc = parse_args(["--config", path, "gc", "--all"], {})
    assert gc.every == "5m"


def test_config_file_from_the_environment_and_switches_from_env(tmp_path):
    path = write(tmp_path, "trigger-seconds = 2\n")
    args = run_args([], {"ONCEFLOW_CONFIG": path, "ONCEFLOW_AVAILABLE_NOW": "yes"})
    assert args.trigger_seconds == 2.0 and args.available_now is True


def test_redis_url_reads_its_usual_variable_over_the_file(tmp_path):
    path = write(tmp_path, 'redis-url = "redis://from-file:6379/0"\n')
    assert run_args(["--config", path]).redis_url == "redis://from-file:6379/0"
    environ = {"REDIS_URL": "redis://from-env:6379/0"}
    assert run_args(["--config", path], environ).redis_url == "redis://from-env:6379/0"


def test_spark_settings_from_file_and_flags_flags_last(tmp_path):
    path = write(
        tmp_path,
        """
        [spark]
        executor.memory = "2g"
        sql.session.timeZone = "UTC"
        [run.spark]
        executor.memory = "3g"
        """,
    )
    args = run_args(
        ["--config", path, "--conf", "spark.executor.memory=4g", "--spark-ui-port", "4050"]
    )
    assert spark_conf(args) == {
        "spark.executor.memory": "4g",
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.enabled": "true",
        "spark.ui.port": "4050",
    }


@pytest.mark.parametrize(
    ("toml", "environ", "message"),
    [
        ("bogus = 1\n", {}, "unknown key 'bogus' in"),
        ("[gc]\nmaster = 'local'\n", {}, "`onceflow gc` has no --master option"),
        ("parallelism = 'two'\n", {}, "--parallelism takes an integer, got 'two'"),
        ("parallelism = true\n", {}, "--parallelism takes an integer, got True"),
        ("log-level = 'loud'\n", {}, "--log-level must be one of error, warn"),
        ("no-progress = 'maybe'\n", {}, "--no-progress is a switch"),
        ("run = 3\n", {}, "[run] in"),
        ("master = [\n", {}, "is not valid TOML"),
        ("", {"ONCEFLOW_METRICS_PORT": "http"}, "$ONCEFLOW_METRICS_PORT: --metrics-port takes"),
    ],
)
def test_bad_config_is_one_error_line_and_status_2(tmp_path, capsys, toml, environ, message):
    path = write(tmp_path, toml)
    old = dict(os.environ)
    os.environ.update(environ)
    try:
        code = main(["run", "--config", path, str(tmp_path / "pipe.py")])
    finally:
        os.environ.clear()
        os.environ.update(old)
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


def test_missing_config_file_is_an_error(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "none.toml"), "status", "--all"]) == 2
    assert "cannot read config file" in capsys.readouterr().err


def test_malformed_conf_is_an_error(tmp_path, capsys):
    assert main(["run", str(tmp_path / "p.py"), "--conf", "executor.memory"]) == 2
    assert "--conf takes spark.key=value" in capsys.readouterr().err


def test_reset_confirmation_is_never_read_from_a_file(tmp_path, capsys):
    path = write(tmp_path, "[reset]\nyes = true\n")
    assert main(["--config", path, "reset", "--namespace", "x"]) == 2
    assert "has no --yes option" in capsys.readouterr().err


BOUNDED = textwrap.dedent("""
    import os
    from onceflow.pipeline import Pipeline, sinks, sources

    pipeline = Pipeline("conf-probe")
    (pipeline.read("nums", sources.Collection([1, 2, 3]))
     .map("probe", lambda x: [x, os.environ.get("ONCEFLOW_PROBE")])
     .write("out", sinks.JsonLines(OUT)))
""")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.spark
def test_conf_log_level_and_spark_ui_reach_a_new_session(tmp_path):
    """A real session in a child process: --conf (over the file's [spark]), the log level
    in the log file, the Spark UI on the asked port."""
    out = tmp_path / "out.jsonl"
    pipe = tmp_path / "pipe.py"
    pipe.write_text(f"OUT = {str(out)!r}\n" + BOUNDED)
    config = write(tmp_path, '[spark]\nexecutorEnv.ONCEFLOW_PROBE = "from-file"\n')
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "onceflow", "run", str(pipe), "--config", config]
        + ["--conf", "spark.executorEnv.ONCEFLOW_PROBE=from-flag", "--log-level", "info"]
        + ["--spark-ui-port", str(port), "--no-progress", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = sorted(json.loads(line) for line in out.read_text().splitlines())
    assert rows == [[1, "from-flag"], [2, "from-flag"], [3, "from-flag"]]
    assert f"Spark UI: http://127.0.0.1:{port}" in result.stderr.replace("localhost", "127.0.0.1")
    log_line = next(line for line in result.stderr.splitlines() if line.startswith("log (info): "))
    log_text = open(log_line.split(": ", 1)[1], encoding="utf-8").read()
    assert " INFO SparkContext: " in log_text
    assert "ERROR" not in result.stderr and "INFO" not in result.stderr  # quiet terminal
    assert "Setting default log level" not in result.stderr  # Spark kept the level asked for

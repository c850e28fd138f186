"""One list of run options (issue 29): ``onceflow run``'s flags, the environment, the TOML file
and ``Pipeline.run`` are all views of ``RunConfig``; a misspelt name in any of them is one
error line naming it and the closest known name. No Spark, Redis or Kafka is started."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from onceflow.cli.commands import run_config
from onceflow.cli.main import build_parser, commands_of, main, parse_args
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.records import Guarantee
from onceflow.pipeline import Pipeline, sinks, sources
from onceflow.runtime.driver.run_config import RunConfig, dest, flagged, options, value_type

ROOT = Path(__file__).resolve().parents[2]
# Flags of `onceflow run` that are no setting of the run itself: the pipeline to load and its
# plan, and the Spark session's settings (they make RunConfig.spark_conf).
NOT_SETTINGS = {"--pipeline", "--no-optimize", "--rules", "--spark-ui", "--spark-ui-port", "--conf"}


def one_error_line(capsys, code: int) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def run_main(argv, environ=None):
    old = dict(os.environ)
    os.environ.update(environ or {})
    try:
        return main(argv)
    finally:
        os.environ.clear()
        os.environ.update(old)


@pytest.mark.parametrize(
    ("argv", "named", "suggested"),
    [
        (["--metrics-prot", "9100"], "--metrics-prot", "--metrics-port"),
        (["--availabe-now"], "--availabe-now", "--available-now"),
        (["--redis-restrats=2"], "--redis-restrats", "--redis-restarts"),
    ],
)
def test_a_misspelt_flag_is_one_line_with_the_closest(tmp_path, capsys, argv, named, suggested):
    line = one_error_line(capsys, run_main(["run", str(tmp_path / "pipe.py"), *argv]))
    assert f"no option {named};" in line and f"did you mean {suggested}?" in line


@pytest.mark.parametrize(
    ("toml", "named", "suggested"),
    [
        ("metrics-prot = 9100\n", "'metrics-prot'", "'metrics-port'"),
        ("[run]\nmax-records-per-bach = 10\n", "'max-records-per-bach'", "'max-records-per-batch'"),
    ],
)
def test_a_misspelt_file_key_is_one_line_with_the_closest(tmp_path, capsys, toml, named, suggested):
    path = tmp_path / "onceflow.toml"
    path.write_text(toml)
    code = run_main(["run", "--config", str(path), str(tmp_path / "pipe.py")])
    line = one_error_line(capsys, code)
    assert f"unknown key {named}" in line and f"did you mean {suggested}?" in line


def test_a_misspelt_variable_is_one_line_with_the_closest(tmp_path, capsys):
    code = run_main(["run", str(tmp_path / "pipe.py")], {"ONCEFLOW_METRICS_PROT": "9100"})
    line = one_error_line(capsys, code)
    assert "ONCEFLOW_METRICS_PROT" in line and "did you mean ONCEFLOW_METRICS_PORT?" in line


def test_a_variable_far_from_every_option_is_left_alone():
    """A user's own ONCEFLOW_ variable is none of Onceflow's business."""
    args = parse_args(["run", "pipe.py"], {"ONCEFLOW_TEAM_NAME": "payments"})
    assert args.master == RunConfig().master


def bounded_pipeline(tmp_path):
    p = Pipeline("settings-probe")
    p.read("nums", sources.Collection([1])).write("out", sinks.JsonLines(str(tmp_path / "o")))
    return p


@pytest.mark.parametrize(
    ("settings", "named", "suggested"),
    [
        ({"metrics_prot": 9100}, "'metrics_prot'", "'metrics_port'"),
        ({"stop_after_batch": 1}, "'stop_after_batch'", "'stop_after_batches'"),
        ({"progres": False}, "'progres'", "'progress'"),
    ],
)
def test_a_misspelt_run_keyword_is_one_line_with_the_closest(tmp_path, settings, named, suggested):
    with pytest.raises(ConfigError) as caught:
        bounded_pipeline(tmp_path).run(**settings)  # refused before Spark starts
    message = str(caught.value)
    assert "\n" not in message and named in message and f"did you mean {suggested}?" in message


# A value of each type for a flag, and what the configuration then holds.
SAMPLES = {int: ("7", 7), float: ("2.5", 2.5), str: ("x-1", "x-1")}


def sample(f):
    option = f.metadata["option"]
    if option.switch:
        return [option.flag], not f.default
    if option.choices:
        text = next(c for c in option.choices if c != getattr(f.default, "value", f.default))
        return [option.flag, text], Guarantee(text) if f.name == "guarantee" else text
    text, value = SAMPLES[value_type(f)]
    return [option.flag, text], value


@pytest.mark.parametrize("f", flagged(), ids=lambda f: f.metadata["option"].flag)
def test_every_generated_flag_round_trips_into_the_config(f, tmp_path):
    """Its flag, its variable and its file key each set the field; unset, it is the default."""
    argv, expected = sample(f)
    assert getattr(run_config(parse_args(["run", "pipe.py"], {})), f.name) == f.default
    flag_config = run_config(parse_args(["run", "pipe.py", *argv], {}))
    assert getattr(flag_config, f.name) == expected
    switch = f.metadata["option"].switch
    variable = "ONCEFLOW_" + dest(f).upper()
    env_config = run_config(parse_args(["run", "pipe.py"], {variable: "1" if switch else argv[-1]}))
    assert getattr(env_config, f.name) == expected
    raw = argv[-1] if value_type(f) in (int, float) and not f.metadata["option"].choices else None
    value = "true" if switch else raw or f'"{argv[-1]}"'
    path = tmp_path / "onceflow.toml"
    path.write_text(f"[run]\n{f.metadata['option'].flag[2:]} = {value}\n")
    file_config = run_config(parse_args(["--config", str(path), "run", "pipe.py"], {}))
    assert getattr(file_config, f.name) == expected


def test_run_has_a_flag_for_each_flagged_field_and_no_other_setting():
    run = commands_of(build_parser())["run"]
    flags = {s for a in run._actions for s in a.option_strings if s.startswith("--")}  # noqa: SLF001
    fields = {f.metadata["option"].flag for f in flagged()}
    assert flags - {"--help", "--config"} == fields | NOT_SETTINGS


def run_options_section() -> str:
    text = (ROOT / "docs" / "guide" / "configuration.md").read_text(encoding="utf-8")
    return text.split("## Run options", 1)[1].split("\n### ", 1)[0]


def test_the_docs_table_lists_exactly_the_run_options():
    table = [line for line in run_options_section().splitlines() if line.startswith("| `")]
    listed = {flag for line in table for flag in re.findall(r"--[a-z][a-z-]*", line.split("|")[1])}
    fields = {f.metadata["option"].flag for f in flagged()}
    assert listed == fields | NOT_SETTINGS


def test_the_docs_list_the_settings_only_pipeline_run_takes():
    marker = "Settings only `pipeline.run(...)` takes:"
    section = run_options_section()
    assert marker in section, "the docs no longer say which settings only Pipeline.run takes"
    said = section.split(marker, 1)[1].split("`--", 1)[0]  # up to the command line's own
    listed = set(re.findall(r"`([a-z_]+)`", said))
    unflagged = {f.name for f in options() if f.metadata["option"].flag is None}
    assert listed == unflagged | {"session", "config", "rules"}


def test_guarantee_is_the_enum_inside_and_text_at_the_edges():
    assert RunConfig.from_settings({"guarantee": "at-least-once"}).guarantee is (
        Guarantee.AT_LEAST_ONCE
    )
    with pytest.raises(ConfigError, match="guarantee must be one of exactly-once, at-least-once"):
        RunConfig.from_settings({"guarantee": "exactly-twice"})
    with pytest.raises(ConfigError, match="guarantee must be one of"):
        RunConfig(guarantee=Guarantee.BOUNDED)


def test_a_flag_only_the_command_line_acts_on_is_refused_by_pipeline_run(tmp_path):
    with pytest.raises(ConfigError, match=r"--kafka-start-wait or \$ONCEFLOW_KAFKA_START_WAIT"):
        bounded_pipeline(tmp_path).run(kafka_start_wait="90s")


def test_a_redis_password_is_not_in_the_configs_repr():
    config = RunConfig(redis_url="redis://:s3cret@h:6379/0", redis_options={"password": "p4ss"})
    assert "s3cret" not in repr(config) and "p4ss" not in repr(config)


def test_keywords_given_with_a_config_win(tmp_path):
    base = RunConfig(parallelism=3, output_dir=str(tmp_path))
    changed = base.replace(parallelism=4)
    assert (changed.parallelism, changed.output_dir) == (4, str(tmp_path))
    with pytest.raises(ConfigError, match="did you mean 'parallelism'"):
        base.replace(paralelism=4)


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"max_records_per_batch": "100"}, "max_records_per_batch must be a whole number, got str"),
        ({"available_now": 1}, "available_now must be True or False, got int"),
        ({"trigger_seconds": "5"}, "trigger_seconds must be a number, got str"),
        ({"parallelism": None}, "parallelism must be set, got None"),
    ],
)
def test_a_value_of_the_wrong_type_is_one_line_naming_the_setting(settings, said):
    with pytest.raises(ConfigError, match=said):
        RunConfig.from_settings(settings)
    assert RunConfig.from_settings({"trigger_seconds": 5}).trigger_seconds == 5  # int is a number

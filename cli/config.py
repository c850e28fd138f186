"""Options from a TOML file and the environment, beneath the command line.

Precedence, highest first: a flag on the command line, an environment variable, the config
file (``--config PATH`` or ``$ONCEFLOW_CONFIG``), the built-in default.

* Environment: ``ONCEFLOW_<OPTION>`` for any option (``--metrics-port`` is
  ``ONCEFLOW_METRICS_PORT``, ``--no-progress`` is ``ONCEFLOW_NO_PROGRESS=1``); ``--redis-url``
  also reads ``REDIS_URL`` and ``--bootstrap-servers`` ``KAFKA_BOOTSTRAP_SERVERS``. Repeatable
  options (``--conf``, ``--namespace``) are not read from the environment. An ``ONCEFLOW_``
  variable that is no option but nearly the name of one (``ONCEFLOW_METRICS_PROT``) is an
  error naming the option; one far from every option is left alone (it may be the user's).
* Config file: top-level keys are option names (``redis-url = "redis://..."``) and apply to
  every command that has the option; a table named after a command (``[run]``, ``[gc]``) applies
  to that command only and wins over the top level; a ``[spark]`` table (top level or
  ``[run.spark]``) holds Spark settings, ``--conf`` with the ``spark.`` prefix left out
  (``executor.memory = "2g"``). A key no command knows, or a value of the wrong type, is an
  error naming the key and the file (and the closest option, when one is close).

The options of ``onceflow run`` are generated from
:class:`~onceflow.runtime.driver.run_config.RunConfig`, so this module checks the file and the
environment against that one list.

``--yes`` and ``--force`` (the confirmations of ``onceflow reset``) and ``--wipe`` (of
``onceflow dev down``) are never read from a file or the environment.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping
from typing import Any

from onceflow.cli.errors import ConfigFileError
from onceflow.runtime.driver.run_config import ENV_PREFIX, closest

CONFIG_ENV = "ONCEFLOW_CONFIG"
# Variables of Onceflow that are not options: never mistaken for a misspelt one.
OTHER_VARIABLES = frozenset(
    {
        CONFIG_ENV,
        "ONCEFLOW_BENCH_BROKER_PID",
        "ONCEFLOW_BENCH_READ_IN_TASK",
        "ONCEFLOW_CACHE",
        "ONCEFLOW_CACHE_DIR",
        "ONCEFLOW_CLOCK_OFFSET_MS",
        "ONCEFLOW_CRASH",
        "ONCEFLOW_CRASH_FILE",
        "ONCEFLOW_CRASH_PAUSE_S",
        "ONCEFLOW_FSYNC_LOG",
        "ONCEFLOW_JVM_ARCHIVE",
        "ONCEFLOW_JVM_ARCHIVE_DUMP",
        "ONCEFLOW_KAFKA_END_OFFSETS",
        "ONCEFLOW_KAFKA_HOME",
        "ONCEFLOW_LONG_TESTS",
        "ONCEFLOW_SHARED_DIRS",
        "ONCEFLOW_SPARK_KAFKA_JARS",
        "ONCEFLOW_TEST_BROKER",
        "ONCEFLOW_WARM_WORKERS",
        "ONCEFLOW_WORKER_PRELOAD",
    }
)
MISSPELT = 0.85  # how alike a variable's name and an option's must be to call it a misspelling
ENV_ALIASES = {"redis_url": ("REDIS_URL",), "bootstrap_servers": ("KAFKA_BOOTSTRAP_SERVERS",)}
# Said on the command line or not at all.
NOT_LAYERED = frozenset({"help", "version", "config", "yes", "force", "wipe"})
SPARK_TABLE = "spark"
SPARK_CONF_DEST = "conf"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def read_config(path: str) -> dict[str, Any]:
    """The TOML file's contents; a :class:`ConfigFileError` when it cannot be read."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        msg = f"cannot read config file {path}: {exc.strerror or exc}"
        raise ConfigFileError(msg) from None
    except tomllib.TOMLDecodeError as exc:
        msg = f"config file {path} is not valid TOML: {exc}"
        raise ConfigFileError(msg) from None


def options_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """A command's options that a config file or the environment may set, by key."""
    return {
        a.dest: a
        for a in parser._actions  # noqa: SLF001 - argparse has no public list of its options
        if a.option_strings and not a.required and a.dest not in NOT_LAYERED
    }


def _key(name: str) -> str:
    return name.replace("-", "_")


def _flag(dest: str) -> str:
    return dest.replace("_", "-")


def check_config(
    config: Mapping[str, Any], commands: Mapping[str, argparse.ArgumentParser], path: str
) -> None:
    """Refuse keys no command knows and tables that are not tables."""
    known = {k for parser in commands.values() for k in options_of(parser)}
    for key, value in config.items():
        if key in commands:
            _check_table(value, f"[{key}]", path)
            own = options_of(commands[key])
            for inner, item in value.items():
                if inner == SPARK_TABLE and SPARK_CONF_DEST in own:
                    _check_table(item, f"[{key}.{SPARK_TABLE}]", path)
                elif _key(inner) not in own:
                    near = closest(_flag(_key(inner)), [_flag(k) for k in own])
                    flags = ", ".join(sorted(_flag(k) for k in own)) or "none"
                    hint = f"did you mean {near!r}?" if near else f"its options: {flags}"
                    msg = (
                        f"unknown key {inner!r} in [{key}] of {path}: `onceflow {key}` has no "
                        f"--{_flag(_key(inner))} option ({hint})"
                    )
                    raise ConfigFileError(msg)
        elif key == SPARK_TABLE:
            _check_table(value, f"[{SPARK_TABLE}]", path)
        elif _key(key) not in known:
            near = closest(_flag(_key(key)), [_flag(k) for k in known])
            if near is not None:
                msg = f"unknown key {key!r} in {path}: did you mean {near!r}?"
            else:
                msg = (
                    f"unknown key {key!r} in {path}: expected an option name (e.g. redis-url, "
                    f"master, metrics-port), a command table "
                    f"({', '.join(f'[{c}]' for c in commands)}) or [{SPARK_TABLE}]"
                )
            raise ConfigFileError(msg)


def check_environment(
    environ: Mapping[str, str], commands: Mapping[str, argparse.ArgumentParser]
) -> None:
    """Refuse an ``ONCEFLOW_`` variable that is no option but close to one (a misspelling).

    A variable far from every option is left alone: it may be the user's own.
    """
    variables = {
        ENV_PREFIX + dest.upper()
        for parser in commands.values()
        for dest, action in options_of(parser).items()
        if not isinstance(action, argparse._AppendAction)  # noqa: SLF001 - not from the env
    }
    own = {v[len(ENV_PREFIX) :] for v in variables}
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in variables | OTHER_VARIABLES:
            continue
        near = closest(name[len(ENV_PREFIX) :], own, cutoff=MISSPELT)
        if near is not None:
            msg = (
                f"environment variable {name} is no option of onceflow; did you mean "
                f"{ENV_PREFIX}{near}?"
            )
            raise ConfigFileError(msg)


def _check_table(value: Any, name: str, path: str) -> None:
    if not isinstance(value, dict):
        msg = f"{name} in {path} must be a table, got {value!r}"
        raise ConfigFileError(msg)


def layered_defaults(
    command: str,
    parser: argparse.ArgumentParser,
    config: Mapping[str, Any],
    path: str | None,
    environ: Mapping[str, str] = os.environ,
    origins: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Defaults for ``command``'s options from the environment, else the config file.

    ``origins``, when given, gets where each value came from (``$REDIS_URL``, ``trigger-seconds
    in onceflow.toml``), by destination.
    """
    where: dict[str, str] = {} if origins is None else origins
    own = options_of(parser)
    table = config.get(command, {})
    from_file = {_key(k): (k, v) for k, v in config.items() if not isinstance(v, dict)}
    from_file.update({_key(k): (f"[{command}] {k}", v) for k, v in table.items() if k != "spark"})
    values: dict[str, Any] = {}
    for dest, action in own.items():
        env = _from_env(dest, action, environ)
        if env is not None:
            name, raw = env
            where[dest] = f"${name}"
            values[dest] = convert(action, raw, where[dest])
        elif dest in from_file:
            key, raw = from_file[dest]
            where[dest] = f"{key} in {path}"
            values[dest] = convert(action, raw, where[dest])
    if SPARK_CONF_DEST in own:
        spark = {**_flatten(config.get(SPARK_TABLE, {})), **_flatten(table.get(SPARK_TABLE, {}))}
        pairs = [f"{_spark_key(k)}={_spark_value(v)}" for k, v in spark.items()]
        values[SPARK_CONF_DEST] = pairs + list(values.get(SPARK_CONF_DEST) or [])
    return values


def _from_env(
    dest: str, action: argparse.Action, environ: Mapping[str, str]
) -> tuple[str, str] | None:
    if isinstance(action, argparse._AppendAction):  # noqa: SLF001 - repeatable: flags/file only
        return None
    for name in (ENV_PREFIX + dest.upper(), *ENV_ALIASES.get(dest, ())):
        if environ.get(name):
            return name, environ[name]
    return None


def convert(action: argparse.Action, value: Any, where: str) -> Any:
    """A file's or the environment's value for an option, checked as its flag would be."""
    flag = action.option_strings[-1]
    if action.nargs == 0:  # a switch (store_true)
        return _switch(value, flag, where)
    if isinstance(action, argparse._AppendAction):  # noqa: SLF001
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            msg = f"{where}: {flag} takes a string or a list of strings, got {value!r}"
            raise ConfigFileError(msg)
        return list(items)
    result = _typed(action, value, flag, where)
    if action.choices is not None and result not in action.choices:
        choices = ", ".join(str(c) for c in action.choices)
        msg = f"{where}: {flag} must be one of {choices}, got {value!r}"
        raise ConfigFileError(msg)
    return result


def _switch(value: Any, flag: str, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    msg = f"{where}: {flag} is a switch: use true or false (1 or 0), got {value!r}"
    raise ConfigFileError(msg)


def _typed(action: argparse.Action, value: Any, flag: str, where: str) -> Any:
    kind = action.type
    name = getattr(kind, "__name__", "string") if kind is not None else "string"
    wanted = {"int": "an integer", "float": "a number"}.get(name, "a string")
    if isinstance(value, str):
        if kind is None:
            return value
        try:
            return kind(value)  # type: ignore[operator]
        except (TypeError, ValueError):
            pass
    elif not isinstance(value, bool) and (
        (kind is int and isinstance(value, int))
        or (kind is float and isinstance(value, int | float))
    ):
        return kind(value)
    msg = f"{where}: {flag} takes {wanted}, got {value!r}"
    raise ConfigFileError(msg)


def _flatten(table: Any, prefix: str = "") -> dict[str, Any]:
    """``{"executor": {"memory": "2g"}}`` -> ``{"executor.memory": "2g"}``."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _spark_key(key: str) -> str:
    return key if key.startswith("spark.") else f"spark.{key}"


def _spark_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)

"""One typed run configuration: every setting of a run, written once.

:class:`RunConfig` is built once per run and handed to the runtime whole
(:func:`~.runner.run`, :func:`~.streaming.run_streaming`).
Each field carries, in its metadata (:class:`Option`), what the other views of a setting
need, so none of them keeps a list of its own:

* ``onceflow run`` generates its options from the fields with a flag (``cli/main.py``): name,
  type, choices, default and help;
* the TOML file and the environment are read through those options (``cli/config.py``), so a
  key or variable is checked against the same list;
* ``Pipeline.run(**settings)`` checks its keywords with :meth:`RunConfig.from_settings`.

A misspelt name is one line naming it and the closest known one (:func:`unknown_name`).
Durations follow the project's rule (:mod:`onceflow.kernel.durations`): a ``*_seconds``
field, ``metrics_linger`` and ``timeout_seconds`` are numbers of seconds; the Kafka waits are
duration text (``90s``, ``3m``; a bare number is seconds). The guarantee is the
:class:`~onceflow.kernel.records.Guarantee` enum inside; its text form only at the edges.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from onceflow.dedup.config import DedupConfig
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.records import Guarantee
from onceflow.runtime.spark_env.session import DEFAULT_LOG_LEVEL, DEFAULT_MASTER, LOG_LEVELS

DEFAULT_PARALLELISM = 2
DEFAULT_OUTPUT_DIR = "onceflow-output"
DEFAULT_TRIGGER_SECONDS = 1.0
DEFAULT_METRICS_HOST = "127.0.0.1"
DEFAULT_REDIS_RESTARTS = 3
STREAMING_GUARANTEES = (Guarantee.EXACTLY_ONCE, Guarantee.AT_LEAST_ONCE)
ENV_PREFIX = "ONCEFLOW_"  # $ONCEFLOW_<FLAG> sets a flag (see onceflow.cli.config)

SPARK_GROUP = "spark"  # options every command starting a Spark session has (run, demo)
STREAMING_GROUP = "streaming"  # options of `onceflow run` only


@dataclass(frozen=True)
class Option:
    """What the command line, the file, the environment and ``Pipeline.run`` know of a field.

    ``flag``: the option of ``onceflow run`` (None: not on the command line, nor in the file
    or environment, which are read through the flags); ``switch``: a flag without a value
    (``invert``: the flag sets the field False, as ``--no-progress``); ``api``: whether
    ``Pipeline.run`` takes it (a flag the CLI itself acts on, such as ``--ui-port``, is not);
    ``streaming``: it only means something to a streaming run (a bounded run refuses it when
    it differs from the default); ``unit``: of a number (``s``) or ``duration`` text.
    """

    help: str
    flag: str | None = None
    group: str = STREAMING_GROUP
    switch: bool = False
    invert: bool = False
    api: bool = True
    streaming: bool = True
    unit: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


def _option(default: Any, help: str, *, secret: bool = False, **kw: Any) -> Any:  # noqa: A002
    """A field with its :class:`Option`; a ``secret`` one (passwords) is left out of ``repr``."""
    return field(default=default, repr=not secret, metadata={"option": Option(help, **kw)})


@dataclass(frozen=True)
class RunConfig:
    """Every setting of a run (bounded or streaming), typed, with its default."""

    master: str = _option(
        DEFAULT_MASTER,
        f"Spark master URL (default {DEFAULT_MASTER}; spark://host:7077 for a cluster)",
        flag="--master",
        group=SPARK_GROUP,
        streaming=False,
    )
    parallelism: int = _option(
        DEFAULT_PARALLELISM,
        "partitions per exchange (fixed for the life of a streaming pipeline)",
        flag="--parallelism",
        group=SPARK_GROUP,
        streaming=False,
    )
    progress: bool = _option(
        True,
        "no progress bar",
        flag="--no-progress",
        group=SPARK_GROUP,
        switch=True,
        invert=True,
        streaming=False,
    )
    output_dir: str = _option(
        DEFAULT_OUTPUT_DIR,
        "where default outputs (dead letters) go",
        flag="--output-dir",
        group=SPARK_GROUP,
        streaming=False,
    )
    log_level: str = _option(
        DEFAULT_LOG_LEVEL,
        "level of Spark's and Onceflow's log, which goes to a file (its path is printed "
        "when a run fails, or at start with a level other than warn); default warn",
        flag="--log-level",
        group=SPARK_GROUP,
        choices=LOG_LEVELS,
        streaming=False,
    )
    code_dir: str | None = _option(
        None,
        "folder of the user's own modules shipped to the workers (onceflow run: the "
        "pipeline file's folder)",
        streaming=False,
    )
    spark_conf: dict[str, str] | None = _option(
        None,
        "settings of the SparkSession the run starts (onceflow run: --conf, --spark-ui)",
        streaming=False,
    )
    redis_url: str | None = _option(
        None, "Redis for exactly-once state (default $REDIS_URL)", flag="--redis-url", secret=True
    )
    redis_options: dict[str, Any] | None = _option(
        None, "further keyword arguments of the Redis client (passwords, TLS)", secret=True
    )
    namespace: str | None = _option(
        None,
        "Redis namespace of the pipeline's state (default: the pipeline's name)",
        flag="--namespace",
    )
    checkpoint: str | None = _option(
        None,
        "Spark checkpoint directory or URL of the query (default "
        "<output-dir>/<pipeline>/checkpoint, resolved against the current folder: resume "
        "from the same folder or pass an absolute path; on a cluster, a URL or path every "
        "machine shares)",
        flag="--checkpoint",
    )
    guarantee: Guarantee = _option(
        Guarantee.EXACTLY_ONCE,
        "exactly-once (default) or at-least-once (no IDs, backup or dedup)",
        flag="--guarantee",
        choices=tuple(g.value for g in STREAMING_GUARANTEES),
    )
    trigger_seconds: float | None = _option(
        None, "micro-batch interval", flag="--trigger-seconds", unit="s"
    )
    available_now: bool = _option(
        False,
        "process what is in the topics now, then stop",
        flag="--available-now",
        switch=True,
    )
    max_records_per_batch: int | None = _option(
        None, "cap on records per micro-batch", flag="--max-records-per-batch"
    )
    stop_after_batches: int | None = _option(
        None, "stop after this many micro-batches", flag="--stop-after-batches"
    )
    timeout_seconds: float | None = _option(
        None, "stop the run after this many seconds (between micro-batches)", unit="s"
    )
    accept_plan_change: bool = _option(
        False,
        "resume a namespace whose stored plan differs from this one (the dedup history "
        "of stages that changed starts over)",
        flag="--accept-plan-change",
        switch=True,
    )
    rescale: bool = _option(
        False,
        "move the keyed state to this run's --parallelism first when the namespace has "
        "another (or finish a rescale cut short); without it another parallelism is refused",
        flag="--rescale",
        switch=True,
    )
    dedup: DedupConfig | None = _option(
        None, "how long duplicates are recognised (default: the pipeline's own)"
    )
    ui_port: int | None = _option(
        None,
        "serve a live page of the run on this port (loopback)",
        flag="--ui-port",
        api=False,
        streaming=False,
    )
    metrics_port: int | None = _option(
        None,
        "serve Prometheus metrics of the run on this port (path /metrics; 0: any free port)",
        flag="--metrics-port",
    )
    metrics_host: str = _option(
        DEFAULT_METRICS_HOST,
        "address the metrics endpoint listens on (default 127.0.0.1; 0.0.0.0 for a "
        "Prometheus on another host)",
        flag="--metrics-host",
    )
    metrics_linger: float | None = _option(
        None,
        "keep serving metrics this many seconds after the run ends, for a last scrape "
        "(SIGTERM or Ctrl-C ends it sooner)",
        flag="--metrics-linger",
        unit="s",
    )
    redis_wait_replicas: int | None = _option(
        None,
        "Redis replicas that must acknowledge each micro-batch before Spark commits it "
        "(default: 1 if Redis has a replica, else 0)",
        flag="--redis-wait-replicas",
    )
    allow_non_durable_redis: bool = _option(
        False,
        "run even if Redis persistence (AOF) is off: exactly-once is then lost when Redis restarts",
        flag="--allow-non-durable-redis",
        switch=True,
    )
    allow_unconfirmed_fsync: bool = _option(
        False,
        "run on a Redis before 7.2 with appendfsync everysec and no replica, which cannot "
        "confirm that a batch reached its disk: after a crash of its host the batch in flight "
        "runs again, a delivery whose record Redis lost is found in its sink (counted once, "
        "or the run stops and says so), and lost results of a committed batch stop the next "
        "start",
        flag="--allow-unconfirmed-fsync",
        switch=True,
    )
    redis_restarts: int = _option(
        DEFAULT_REDIS_RESTARTS,
        "times a micro-batch is run again when its Redis server restarted or failed over "
        "during it (default 3; 0 stops the run at the first)",
        flag="--redis-restarts",
    )
    kafka_start_wait: str | None = _option(
        None,
        "how long the run waits for Kafka to answer when it starts (default 60s)",
        flag="--kafka-start-wait",
        metavar="DURATION",
        unit="duration",
        api=False,  # read by the Kafka connectors when they are built: a flag or variable
        streaming=False,
    )
    kafka_outage_wait: str | None = _option(
        None,
        "how long a running pipeline waits for a Kafka broker that went away (a "
        "restart) before it stops (default 3m)",
        flag="--kafka-outage-wait",
        metavar="DURATION",
        unit="duration",
        api=False,
        streaming=False,
    )

    def __post_init__(self) -> None:
        for f in options():
            wrong = wrong_type(f.name, getattr(self, f.name), _field_types()[f.name])
            if wrong:
                raise ConfigError(wrong)
        if self.guarantee not in STREAMING_GUARANTEES:
            choices = ", ".join(g.value for g in STREAMING_GUARANTEES)
            msg = f"guarantee must be one of {choices}, got {self.guarantee!r}"
            raise ConfigError(msg)

    @classmethod
    def from_settings(
        cls, settings: Mapping[str, Any], where: str = "Pipeline.run", api_only: bool = True
    ) -> RunConfig:
        """The configuration of keyword settings; a misspelt name is a one-line error.

        ``guarantee`` may be given as text (``"at-least-once"``). With ``api_only`` (the
        default: ``Pipeline.run``), the settings only a command-line flag takes (read before
        the pipeline is built, such as ``--kafka-start-wait``) are refused, saying so.
        """
        names = {f.name: f.metadata["option"] for f in options()}
        for name in settings:
            option = names.get(name)
            if option is None:
                api = [n for n, o in names.items() if o.api or not api_only]
                raise ConfigError(unknown_name(name, api, where))
            if api_only and not option.api:
                msg = (
                    f"{where} does not take {name!r}: it is an option of `onceflow run` only "
                    f"({option.flag} or ${ENV_PREFIX}{name.upper()})"
                )
                raise ConfigError(msg)
        values = dict(settings)
        if isinstance(values.get("guarantee"), str):
            values["guarantee"] = guarantee_of(values["guarantee"])
        return cls(**values)

    def replace(self, **settings: Any) -> RunConfig:
        """A copy with ``settings`` changed, checked as :meth:`from_settings` checks them."""
        changed = RunConfig.from_settings(settings)
        given = {k: getattr(changed, k) for k in settings}
        return dataclasses.replace(self, **given)

    def streaming_settings(self) -> list[str]:
        """Settings that only a streaming run reads and that differ from their default."""
        return [
            f.name
            for f in options()
            if f.metadata["option"].streaming and getattr(self, f.name) != f.default
        ]


def options() -> tuple[dataclasses.Field[Any], ...]:
    """The fields of :class:`RunConfig`, each with its :class:`Option` (``metadata``)."""
    return dataclasses.fields(RunConfig)


def flagged(group: str | None = None) -> list[dataclasses.Field[Any]]:
    """Fields with a command-line flag (of ``group``, or all)."""
    return [
        f
        for f in options()
        if f.metadata["option"].flag is not None
        and (group is None or f.metadata["option"].group == group)
    ]


def dest(f: dataclasses.Field[Any]) -> str:
    """The argparse destination of a field's flag (``--no-progress`` -> ``no_progress``)."""
    flag = f.metadata["option"].flag
    return str(flag).lstrip("-").replace("-", "_")


def value_type(f: dataclasses.Field[Any]) -> type:
    """The scalar type of a field (``int`` for ``int | None``)."""
    hint = typing.get_type_hints(RunConfig)[f.name]
    if isinstance(hint, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0]
    return typing.get_origin(hint) or hint  # type: ignore[no-any-return]


def guarantee_of(text: str) -> Guarantee:
    """The guarantee named ``text`` (``exactly-once``, ``at-least-once``)."""
    for g in STREAMING_GUARANTEES:
        if g.value == text:
            return g
    choices = ", ".join(g.value for g in STREAMING_GUARANTEES)
    msg = f"guarantee must be one of {choices}, got {text!r}"
    raise ConfigError(msg)


def closest(name: str, known: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The known name ``name`` was most likely meant to be, if one is close."""
    found = difflib.get_close_matches(name, sorted(known), n=1, cutoff=cutoff)
    return found[0] if found else None


def unknown_name(name: str, known: Iterable[str], where: str) -> str:
    """``Pipeline.run has no setting 'metrics_prot'; did you mean 'metrics_port'?``."""
    near = closest(name, known)
    guess = f"; did you mean {near!r}?" if near else f" (its settings: {', '.join(sorted(known))})"
    return f"{where} has no setting {name!r}{guess}"


_PLAIN = {
    int: "a whole number",
    float: "a number",
    str: "text",
    bool: "True or False",
    dict: "a dict",
}


@functools.cache
def _field_types() -> dict[str, Any]:
    """The run configuration's field types, resolved (once: the class must exist first)."""
    return typing.get_type_hints(RunConfig)


def wrong_type(name: str, value: Any, hint: Any) -> str:
    """Why ``value`` does not fit a setting typed ``hint`` ('' when it does).

    Only the plain types are checked (numbers, text, switches, dicts, and None where the
    setting takes it): a number given as text, or a switch as a number, is a one-line error
    here rather than a TypeError deep inside a run.
    """
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    plain = [typing.get_origin(t) or t for t in allowed if t is not type(None)]
    if value is None:
        return "" if type(None) in allowed else f"{name} must be set, got None"
    if any(t not in _PLAIN for t in plain):
        return ""  # a richer type (a guarantee, a dedup config): checked where it is used
    if isinstance(value, bool) and bool not in plain:
        fits = False
    else:
        fits = any(isinstance(value, t) or (t is float and isinstance(value, int)) for t in plain)
    if fits:
        return ""
    want = " or ".join(_PLAIN[t] for t in plain)
    return f"{name} must be {want}, got {type(value).__name__} {value!r}"

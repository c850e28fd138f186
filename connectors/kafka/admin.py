"""Topic administration on the driver: creating topics, and what a topic does to timestamps.

Always kafka-python's admin client (never on the per-record path), one per call, closed after.

**Replication.** Topics Onceflow creates (a sink's topic, the pipeline's delivery log
``<pipeline>.onceflow-deliveries``, its dead letters ``<pipeline>.dead-letters``, and input
topics of the test and demo helpers) get an explicit replication factor: what the sink asks
for (``KafkaSink(replication_factor=...)``), else min(3, brokers of the cluster), with
``min.insync.replicas`` min(2, factor), so that an ``acks=all`` write is on two brokers before
it counts. The cluster's own ``default.replication.factor`` is 1 unless an operator raised
it, which on a cluster of several brokers would leave the outputs on one disk without a word.
What the run's topics are is said once when it starts (:meth:`PreparedTopics.notes`): a
single broker ("Kafka's data is not replicated"), or topics with one replica on a cluster
that has more brokers (topics created before, by someone else or by an older Onceflow).

**Timestamps** (:class:`TopicTimes`). A topic may delete a record on arrival or refuse it for
its timestamp alone: time retention (``retention.ms`` with ``cleanup.policy=delete``) deletes
records stamped longer ago than it, within minutes and without telling the producer, and the
timestamp limits (``message.timestamp.before.max.ms`` / ``after.max.ms``, Kafka 3.6+; before
that ``message.timestamp.difference.max.ms``) make the broker refuse records stamped further
from its clock. The sink reads the topic's effective settings once, when it prepares, and
stamps a record whose event time the topic would delete or refuse with the time of writing
instead (see :class:`~.sink.KafkaSink`). A topic whose ``message.timestamp.type`` is
``LogAppendTime`` stamps every record with the broker's clock itself: nothing to avoid there.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.outage import Wait, describe, transient
from onceflow.kernel.errors import ConfigError

DEFAULT_REPLICAS = 3  # replicas of a new topic, fewer only on a smaller cluster
DEFAULT_MIN_INSYNC = 2  # ... of which an acks=all write must reach this many
CLUSTER_DEFAULT_REPLICATION = -1  # the cluster chooses (when its brokers cannot be counted)
MIN_INSYNC_CONFIG = "min.insync.replicas"

DAY_MS = 86_400_000
NO_LIMIT = 2**63 - 1  # Long.MAX_VALUE: Kafka's "no limit" for the timestamp limits
# An event time is kept only if the topic then keeps the record at least this long (half
# the retention on a topic keeping records for less than two days): a reader a few hours
# behind must still find it.
RETENTION_KEEP_MS = DAY_MS
# How far inside a timestamp limit an event time must be: the broker judges it by its own
# clock when the record arrives, which may be behind or ahead of the worker's.
LIMIT_SLACK_MS = 5 * 60_000
TIME_CONFIGS = (
    "cleanup.policy",
    "retention.ms",
    "message.timestamp.type",
    "message.timestamp.before.max.ms",
    "message.timestamp.after.max.ms",
    "message.timestamp.difference.max.ms",
)
# A topic just created may not be known yet to the broker answering DescribeConfigs.
DESCRIBE_ATTEMPTS = 20
DESCRIBE_RETRY_S = 0.25


@dataclass(frozen=True)
class TopicTimes:
    """Which timestamps a topic keeps: within ``max_age_ms`` behind and ``max_lead_ms`` ahead.

    None: no bound on that side (no time retention, no limit, or the broker stamps records
    itself). The bounds already leave the margins of :data:`RETENTION_KEEP_MS` and
    :data:`LIMIT_SLACK_MS`; ``why`` names the settings they come from, for messages.
    """

    max_age_ms: int | None = None
    max_lead_ms: int | None = None
    why: str = ""

    def keeps(self, ts: int, now_ms: int) -> bool:
        """Whether a record stamped ``ts`` is neither deleted on arrival nor refused."""
        age = now_ms - ts
        if self.max_age_ms is not None and age > self.max_age_ms:
            return False
        return self.max_lead_ms is None or -age <= self.max_lead_ms

    @classmethod
    def of(cls, config: Mapping[str, str]) -> TopicTimes:
        """The bounds of a topic with these effective settings (:data:`TIME_CONFIGS`)."""
        if config.get("message.timestamp.type") == "LogAppendTime":
            return cls()
        ages: list[tuple[int, str]] = []
        leads: list[tuple[int, str]] = []
        retention = _limit(config.get("retention.ms"))
        if retention is not None and "delete" in config.get("cleanup.policy", "delete"):
            keep = min(retention // 2, RETENTION_KEEP_MS)
            ages.append((retention - keep, f"retention.ms={retention}"))
        for name, sides in (
            ("message.timestamp.before.max.ms", (ages,)),
            ("message.timestamp.after.max.ms", (leads,)),
            ("message.timestamp.difference.max.ms", (ages, leads)),
        ):
            limit = _limit(config.get(name))
            if limit is not None:
                for side in sides:
                    side.append((limit - min(limit // 2, LIMIT_SLACK_MS), f"{name}={limit}"))
        age = min(ages, default=None)
        lead = min(leads, default=None)
        why = ", ".join(sorted({w for _, w in ages + leads}))
        return cls(age[0] if age else None, lead[0] if lead else None, why)


def _limit(value: str | None) -> int | None:
    """A retention or limit setting in ms; None for none (missing, negative or Long.MAX)."""
    if value is None:
        return None
    try:
        ms = int(value)
    except ValueError:
        return None
    return ms if 0 <= ms < NO_LIMIT else None


@dataclass(frozen=True)
class Replication:
    """The replication factor of new topics, and how many replicas an acknowledged write needs."""

    factor: int
    min_insync: int | None

    def configs(self, given: Mapping[str, str]) -> dict[str, str]:
        """A new topic's settings: ``given``, with ``min.insync.replicas`` unless it names one."""
        out = dict(given)
        if self.min_insync is not None:
            out.setdefault(MIN_INSYNC_CONFIG, str(self.min_insync))
        return out


def choose_replication(brokers: int | None, asked: int | None, who: str) -> Replication:
    """``asked``, else min(3, brokers); ``min.insync.replicas`` min(2, factor).

    With the brokers unknown (the cluster did not say) and nothing asked, the cluster's
    default decides. A factor the cluster cannot hold is refused here, in one line, rather
    than by Kafka when the first topic is created.
    """
    if asked is not None and asked < 1:
        msg = f"{who}: replication_factor must be 1 or more, got {asked}"
        raise ConfigError(msg)
    if asked is None and brokers is None:
        return Replication(CLUSTER_DEFAULT_REPLICATION, None)
    factor = asked if asked is not None else min(DEFAULT_REPLICAS, brokers or 1)
    if brokers is not None and factor > brokers:
        msg = (
            f"{who}: replication_factor={factor}, but the Kafka cluster has {brokers} "
            f"broker(s); ask for {brokers} or fewer (or leave it out: min(3, brokers))"
        )
        raise ConfigError(msg)
    return Replication(factor, min(DEFAULT_MIN_INSYNC, factor))


def replication_notes(brokers: int | None, factors: Mapping[str, int]) -> list[str]:
    """What to tell a person about the replication of these topics (empty: nothing wrong).

    One note per fact, the same words for the same fact, so that notes of several sinks
    (which share the delivery log and the cluster) can be said once each.
    """
    if brokers == 1:
        return [
            "single broker: Kafka's data is not replicated: a lost disk loses what the "
            "pipeline wrote. Run 3 brokers for outputs that outlive one"
        ]
    if brokers is None or brokers < 2:
        return []
    return [
        f"Kafka topic {topic!r} has replication factor 1 on a cluster of {brokers} brokers: a "
        "lost disk loses its records. Add replicas (kafka-reassign-partitions.sh) or re-create it"
        for topic in sorted(t for t, f in factors.items() if f == 1)
    ]


@dataclass(frozen=True)
class TopicRequest:
    """A topic a connector needs: created with these partitions and settings if missing."""

    name: str
    partitions: int
    configs: Mapping[str, str] = field(default_factory=dict)
    create: bool = True


@dataclass(frozen=True)
class PreparedTopics:
    """What :func:`prepare_topics` found: timestamp bounds per topic, and notes for a person."""

    times: dict[str, TopicTimes]
    notes: list[str]


_answered: set[str] = set()  # bootstrap servers that answered this process once
# One attempt at a first connection (a progress line comes every 10 s: two attempts a line).
CONNECT_ATTEMPT_S = 5.0


def await_kafka(settings: KafkaSettings) -> None:
    """Return once Kafka answers (a run's first connection; once per process and servers).

    A Kafka that does not answer is waited for up to ``settings.start_wait_s``, with a
    progress line every 10 s, then :class:`KafkaUnavailable` says in one line which servers
    and what to check; a refusal (a wrong password, say) is one line at once.
    """
    if settings.bootstrap_servers in _answered:
        return
    wait = Wait(settings, "connecting", start=True)
    while True:
        try:
            _list_topics(settings, min(CONNECT_ATTEMPT_S, max(1.0, wait.left_s)))
            break
        except Exception as exc:
            if not transient(exc):
                msg = (
                    f"cannot use Kafka at {settings.bootstrap_servers}: {describe(exc)}; check "
                    "the KAFKA_* settings (or the connector's connection= options)"
                )
                raise ConnectorError(msg) from exc
            wait.failed(exc)
    _answered.add(settings.bootstrap_servers)


def _list_topics(settings: KafkaSettings, timeout_s: float) -> None:
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(
        **{"bootstrap_timeout_ms": int(timeout_s * 1000), **settings.client_config()}
    )
    try:
        admin.list_topics()
    finally:
        admin.close()


@contextlib.contextmanager
def admin_client(settings: KafkaSettings) -> Iterator[Any]:
    """kafka-python's admin client with these settings, closed after.

    Waits for a Kafka that does not answer yet (:func:`await_kafka`).
    """
    from kafka.admin import KafkaAdminClient

    await_kafka(settings)
    admin = KafkaAdminClient(**settings.client_config())
    try:
        yield admin
    finally:
        admin.close()


def prepare_topics(
    settings: KafkaSettings,
    requests: Sequence[TopicRequest],
    replication_factor: int | None,
    who: str,
    timed: Sequence[str] = (),
) -> PreparedTopics:
    """Create the missing topics; read the ``timed`` topics' timestamp bounds and all replicas.

    A topic whose settings cannot be read (no DescribeConfigs permission, a broker without
    it) gets no bounds, and a note saying so.
    """
    with admin_client(settings) as admin:
        brokers = broker_count(admin)
        replication = choose_replication(brokers, replication_factor, who)
        created = create_missing(admin, [r for r in requests if r.create], replication, who)
        times: dict[str, TopicTimes] = {}
        notes: list[str] = []
        for topic in timed:
            try:
                times[topic] = TopicTimes.of(describe_times(admin, topic, topic in created))
            except Exception as exc:  # noqa: BLE001 - the sink still works, without the rule
                times[topic] = TopicTimes()
                notes.append(
                    f"cannot read the settings of Kafka topic {topic!r} ({type(exc).__name__}: "
                    f"{exc}): its records keep their event time as their timestamp, even one "
                    "the topic's retention deletes at once; KafkaSink(timestamp='write') "
                    "stamps them with the time of writing"
                )
        notes += replication_notes(brokers, replicas_of(admin, [r.name for r in requests]))
    return PreparedTopics(times, notes)


def broker_count(admin: Any) -> int | None:
    """How many brokers the cluster has registered (fenced ones too); None if it won't say."""
    try:
        return len(admin.describe_cluster()["brokers"]) or None
    except Exception:  # noqa: BLE001 - an old broker, or one without DescribeCluster
        return None


def create_missing(
    admin: Any, requests: Sequence[TopicRequest], replication: Replication, who: str
) -> set[str]:
    """Create the requested topics that do not exist yet; return their names."""
    from kafka.admin import NewTopic
    from kafka.errors import InvalidReplicationFactorError, TopicAlreadyExistsError

    if not requests:
        return set()
    existing = set(admin.list_topics())
    missing = [r for r in requests if r.name not in existing]
    if not missing:
        return set()
    topics = [
        NewTopic(
            r.name, r.partitions, replication.factor, topic_configs=replication.configs(r.configs)
        )
        for r in missing
    ]
    try:
        admin.create_topics(topics)
    except TopicAlreadyExistsError:
        pass
    except InvalidReplicationFactorError as exc:
        msg = (
            f"{who}: Kafka refused to create {', '.join(r.name for r in missing)} with "
            f"replication factor {replication.factor}: {exc}; are brokers down? Give "
            "KafkaSink(replication_factor=...) the number of brokers that are up"
        )
        raise ConnectorError(msg) from exc
    return {r.name for r in missing}


def describe_times(admin: Any, topic: str, created: bool = False) -> dict[str, str]:
    """The topic's effective values of :data:`TIME_CONFIGS` (its own, else the broker's).

    Kafka answers nothing (no error either) for a topic it does not know: one just
    ``created`` is asked again a few times, since the broker answering may not know it yet.
    """
    from kafka.admin import ConfigResource, ConfigResourceType

    wanted = dict.fromkeys(TIME_CONFIGS)
    attempts = DESCRIBE_ATTEMPTS if created else 1
    for attempt in range(attempts):
        resource = ConfigResource(ConfigResourceType.TOPIC, topic, configs=dict(wanted))
        found = admin.describe_configs([resource], config_filter="all")
        entries = found.get("topic", {}).get(topic, {})
        if entries:
            return {k: v["value"] for k, v in entries.items() if v.get("value") is not None}
        if attempt + 1 < attempts:
            time.sleep(DESCRIBE_RETRY_S)
    msg = f"Kafka returned no settings for topic {topic!r}; does it exist?"
    raise ConnectorError(msg)


def replicas_of(admin: Any, topics: Sequence[str]) -> dict[str, int]:
    """Each topic's replication factor (its smallest over partitions); unknown ones left out."""
    try:
        described = admin.describe_topics(list(dict.fromkeys(topics)))
    except Exception:  # noqa: BLE001 - notes only
        return {}
    out: dict[str, int] = {}
    for topic in described:
        counts = [len(p.get("replica_nodes") or ()) for p in topic.get("partitions") or ()]
        if topic.get("error_code", 0) == 0 and counts:
            out[topic["name"]] = min(counts)
    return out


def ensure_topics(
    settings: KafkaSettings,
    topics: Sequence[str],
    partitions: int,
    configs: Mapping[str, str] | None = None,
    replication_factor: int | None = None,
) -> None:
    """Create missing topics, replicated as :func:`choose_replication` says."""
    with admin_client(settings) as admin:
        replication = choose_replication(broker_count(admin), replication_factor, "Kafka")
        requests = [TopicRequest(t, partitions, dict(configs or {})) for t in topics]
        create_missing(admin, requests, replication, "Kafka")

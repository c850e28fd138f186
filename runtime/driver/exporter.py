"""Prometheus metrics of a streaming run, served by its driver (``onceflow run --metrics-port``).

The driver feeds the exporter once per micro-batch (:meth:`RunExporter.observe`): the run's
task counters (the accumulator of :mod:`~onceflow.runtime.metrics`, summed since the driver
started), the
batch's parameters from Redis (watermark, dedup time, horizon), when GC last passed, and for
Kafka sources where the batch ended against where each partition's readable records end now
(the consumer lag). A scrape reads the last snapshot and never touches Spark, Redis or Kafka.

Every metric carries a ``pipeline`` label. Counters start at zero when a driver starts
(Prometheus' ``rate()`` and ``increase()`` handle the reset):

=====================================================  ==========================================
``onceflow_run_info{namespace,guarantee,version}``     1; the run's identity
``onceflow_run_active``                                1 while the query runs, 0 once it stopped
``onceflow_driver_epoch``                              the fencing epoch of this driver
``onceflow_batches_total``                             micro-batches completed
``onceflow_last_batch_id``                             Spark's id of the last one
``onceflow_batch_duration_seconds``                    histogram of micro-batch durations
``onceflow_last_batch_duration_seconds``               duration of the last one
``onceflow_last_batch_records``                        records it read
``onceflow_input_records_total``                       records source stages decoded (the
                                                       undecodable are dead letters)
``onceflow_input_records_per_second``                  the last batch's records / its duration
``onceflow_stage_records_in_total{stage}``             records a stage read
``onceflow_stage_records_out_total{stage,output}``     records it sent to an output
``onceflow_duplicates_dropped_total{stage}``           copies recognised and dropped
``onceflow_dead_letters_total{stage,reason}``          dead letters, by reason code
``onceflow_bloom_maybe_total{stage}``                  IDs a Bloom filter could not rule out
``onceflow_redis_lookups_total{stage}``                IDs looked up in Redis because of them
``onceflow_replayed_outputs_total{stage}``             outputs re-sent from backup (replays)
``onceflow_stage_events_total{stage,event}``           every other task counter
``onceflow_watermark_timestamp_seconds``               the pipeline watermark (event time)
``onceflow_dedup_time_timestamp_seconds``              the dedup clock (generations follow it)
``onceflow_dedup_horizon_seconds``                     how long copies are recognised
``onceflow_late_floor_timestamp_seconds``              older event times are dead-lettered late
``onceflow_live_generations``                          seen-ID generations each ID is checked in
``onceflow_gc_last_pass_timestamp_seconds``            when ``onceflow gc`` last passed
``onceflow_kafka_end_offset{source,topic,partition}``  where the last batch ended
``onceflow_kafka_readable_offset{...}``                where readable records end now
``onceflow_kafka_consumer_lag{...}``                   records waiting: the difference
=====================================================  ==========================================
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from onceflow.dedup.batch import BatchParams
from onceflow.kernel.errors import ConfigError
from onceflow.runtime.metrics import DEAD_LETTERS, dead_letter_reason, split_counter

DURATION_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
_MS = 1000.0
# Task counters with a metric of their own: counter -> (metric, help).
_STAGE_COUNTERS = {
    "in": ("onceflow_stage_records_in", "Records a stage read."),
    "duplicates_dropped": (
        "onceflow_duplicates_dropped",
        "Copies of records already processed, recognised and dropped.",
    ),
    "bloom_maybe": (
        "onceflow_bloom_maybe",
        "IDs the Bloom filters could not rule out (each needs a Redis lookup).",
    ),
    "redis_lookups": ("onceflow_redis_lookups", "IDs looked up in Redis's seen-ID store."),
    "replayed_outputs": (
        "onceflow_replayed_outputs",
        "Outputs re-sent from upstream backup by a replayed task.",
    ),
}
# Counters not worth exporting as counters: sums of per-task sizes, and the dead-letter total
# (exported by reason).
_SKIPPED = frozenset({"bloom_bytes", DEAD_LETTERS})


@dataclass(frozen=True)
class BatchView:
    """What the exporter shows after one micro-batch.

    ``counters``: the run's task counters so far (``stage/name``); ``offsets``: per
    ``(source, topic, partition)``, where the batch ended and where readable records end now
    (None when Kafka did not answer).
    """

    batch: int
    seconds: float
    records: int
    counters: Mapping[str, int]
    params: BatchParams | None = None
    offsets: Mapping[tuple[str, str, int], tuple[int, int | None]] = field(default_factory=dict)
    gc_last_pass_ms: int | None = None


class MetricsEndpoint:
    """An HTTP ``/metrics`` endpoint of a registry (a run's exporter, GC's metrics)."""

    registry: CollectorRegistry
    _server: Any = None

    def serve(self, host: str, port: int) -> str:
        """Start the HTTP endpoint; its URL (``port`` 0 picks a free one)."""
        try:
            self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            msg = f"cannot serve metrics on {host}:{port}: {exc}; pick another --metrics-port"
            raise ConfigError(msg) from exc
        return f"http://{host}:{self._server.server_port}/metrics"

    def close(self) -> None:
        """Stop the HTTP endpoint."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class RunExporter(MetricsEndpoint, Collector):
    """The metrics of one streaming run, and the HTTP endpoint that serves them."""

    def __init__(
        self, pipeline: str, namespace: str, guarantee: str, version: str, stages: Sequence[str]
    ) -> None:
        self.pipeline = pipeline
        self.info = {"namespace": namespace, "guarantee": guarantee, "version": version}
        self.stages = tuple(stages)
        self.epoch = 0
        self.active = False
        self.batches = 0
        self.records = 0
        self.view: BatchView | None = None
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.durations = Histogram(
            "onceflow_batch_duration_seconds",
            "Micro-batch durations, from the start of the job to Redis durability.",
            ["pipeline"],
            registry=self.registry,
            buckets=DURATION_BUCKETS,
        )
        self._server: Any = None

    # -- feeding ------------------------------------------------------------------------

    def started(self, epoch: int) -> None:
        """The query runs, with this driver epoch."""
        self.epoch = epoch
        self.active = True

    def observe(self, view: BatchView) -> None:
        """A micro-batch completed."""
        self.batches += 1
        self.records += view.records
        self.durations.labels(self.pipeline).observe(view.seconds)
        self.view = view

    def stopped(self) -> None:
        """The query stopped."""
        self.active = False

    # -- a scrape -----------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        """Every metric but the duration histogram, from the last snapshot."""
        view = self.view
        yield from self._run_metrics(view)
        counters = view.counters if view is not None else {}
        yield from self._stage_metrics(counters)
        if view is not None:
            yield from self._time_metrics(view)
            yield from self._lag_metrics(view)

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        metric = GaugeMetricFamily(name, doc, labels=["pipeline"])
        metric.add_metric([self.pipeline], value)
        return metric

    def _run_metrics(self, view: BatchView | None) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "onceflow_run_info", "The run's identity (value 1).", labels=["pipeline", *self.info]
        )
        info.add_metric([self.pipeline, *self.info.values()], 1)
        yield info
        yield self._gauge("onceflow_run_active", "1 while the query runs.", int(self.active))
        yield self._gauge("onceflow_driver_epoch", "Fencing epoch of this driver.", self.epoch)
        for name, doc, value in (
            ("onceflow_batches", "Micro-batches completed by this driver.", self.batches),
            ("onceflow_input_records", "Records read by source stages.", self.records),
        ):
            metric = CounterMetricFamily(name, doc, labels=["pipeline"])
            metric.add_metric([self.pipeline], value)
            yield metric
        if view is None:
            return
        rate = view.records / view.seconds if view.seconds > 0 else 0.0
        yield self._gauge("onceflow_last_batch_id", "Spark's id of the last batch.", view.batch)
        yield self._gauge(
            "onceflow_last_batch_duration_seconds", "Duration of the last batch.", view.seconds
        )
        yield self._gauge(
            "onceflow_last_batch_records", "Records the last batch read.", view.records
        )
        yield self._gauge(
            "onceflow_input_records_per_second", "The last batch's records per second.", rate
        )

    def _stage_metrics(self, counters: Mapping[str, int]) -> Iterator[Metric]:
        own = {
            c: CounterMetricFamily(m, doc, labels=["pipeline", "stage"])
            for c, (m, doc) in _STAGE_COUNTERS.items()
        }
        out = CounterMetricFamily(
            "onceflow_stage_records_out",
            "Records a stage sent to an output (a sink or the next stage).",
            labels=["pipeline", "stage", "output"],
        )
        dead = CounterMetricFamily(
            "onceflow_dead_letters",
            "Records sent to the dead-letter output, by reason code.",
            labels=["pipeline", "stage", "reason"],
        )
        other = CounterMetricFamily(
            "onceflow_stage_events",
            "Other task counters (replayed inputs, late and ahead records, deliveries ...).",
            labels=["pipeline", "stage", "event"],
        )
        for stage in self.stages:  # every stage shows, with zeros before its first record
            own["in"].add_metric([self.pipeline, stage], counters.get(f"{stage}/in", 0))
        for key, value in sorted(counters.items()):
            stage, name = split_counter(key, self.stages)
            reason = dead_letter_reason(name)
            if name == "in":
                continue
            if name in own:
                own[name].add_metric([self.pipeline, stage], value)
            elif name.startswith("out/"):
                out.add_metric([self.pipeline, stage, name[4:]], value)
            elif reason is not None:
                dead.add_metric([self.pipeline, stage, reason], value)
            elif name not in _SKIPPED:
                other.add_metric([self.pipeline, stage, name], value)
        yield from own.values()
        yield from (out, dead, other)

    def _time_metrics(self, view: BatchView) -> Iterator[Metric]:
        p = view.params
        if p is not None:
            yield self._gauge(
                "onceflow_watermark_timestamp_seconds",
                "The pipeline watermark (event time, Unix seconds).",
                p.watermark / _MS,
            )
            yield self._gauge(
                "onceflow_dedup_time_timestamp_seconds",
                "The dedup clock that seen-ID generations follow (Unix seconds).",
                p.dedup_time_ms / _MS,
            )
            yield self._gauge(
                "onceflow_dedup_horizon_seconds",
                "How long a copy of a record is still recognised.",
                p.horizon_ms / _MS,
            )
            yield self._gauge(
                "onceflow_late_floor_timestamp_seconds",
                "Records with older event times are dead-lettered as late (Unix seconds).",
                p.floor_ms / _MS,
            )
            yield self._gauge(
                "onceflow_live_generations",
                "Seen-ID generations each new ID is checked against.",
                len(p.live),
            )
        if view.gc_last_pass_ms is not None:
            yield self._gauge(
                "onceflow_gc_last_pass_timestamp_seconds",
                "When `onceflow gc` last passed over this namespace (Unix seconds).",
                view.gc_last_pass_ms / _MS,
            )

    def _lag_metrics(self, view: BatchView) -> Iterator[Metric]:
        labels = ["pipeline", "source", "topic", "partition"]
        end = GaugeMetricFamily(
            "onceflow_kafka_end_offset", "Where the last micro-batch ended.", labels=labels
        )
        readable = GaugeMetricFamily(
            "onceflow_kafka_readable_offset",
            "Where the partition's readable records end (last stable offset).",
            labels=labels,
        )
        lag = GaugeMetricFamily(
            "onceflow_kafka_consumer_lag",
            "Records in the partition not yet read by a completed micro-batch.",
            labels=labels,
        )
        for (source, topic, partition), (done, now) in sorted(view.offsets.items()):
            values = [self.pipeline, source, topic, str(partition)]
            end.add_metric(values, done)
            if now is not None:
                readable.add_metric(values, now)
                lag.add_metric(values, max(0, now - done))
        yield from (end, readable, lag)

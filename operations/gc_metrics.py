"""Prometheus metrics of ``onceflow gc``: a textfile for cron, or an endpoint for ``--every``.

A GC run from cron lives for seconds: nothing could scrape it. It writes its metrics to a file
instead (``--metrics-file``) in the text format node-exporter's textfile collector reads
(``--collector.textfile.directory``); the file is replaced atomically (written beside it,
then renamed), so a scrape never sees half of it. A long-running ``gc --every`` may also serve
them over HTTP (``--metrics-port``). Totals (passes, keys and bytes removed) come from the
namespace's GC record in Redis, so they keep counting across the processes cron starts.

=============================================================  ==================================
``onceflow_gc_run_success``                                    1 if the last run (every
                                                               namespace) passed, else 0
``onceflow_gc_run_timestamp_seconds``                          when it ended
``onceflow_gc_failures_in_a_row``                              failed runs since the last good
``onceflow_gc_passes_total{namespace}``                        passes ever recorded in Redis
``onceflow_gc_removed_keys_total{namespace}``                  keys they removed
``onceflow_gc_removed_bytes_total{namespace}``                 bytes they freed
``onceflow_gc_last_pass_timestamp_seconds{namespace}``         when this process's last pass ran
``onceflow_gc_last_pass_duration_seconds{namespace}``          how long it took
``onceflow_gc_last_pass_scanned_keys{namespace}``              keys it scanned
``onceflow_gc_last_pass_removed_keys{namespace,kind}``         keys it removed, by kind (seen
                                                               IDs, backups, batch parameters,
                                                               Bloom snapshot fields)
``onceflow_gc_last_pass_removed_bytes{namespace,kind}``        bytes it freed, by kind
``onceflow_gc_last_pass_removed_ids{namespace}``               seen IDs it forgot
``onceflow_gc_last_pass_dry_run{namespace}``                   1 if it only looked
``onceflow_gc_horizon_seconds{namespace}``                     the dedup horizon it kept
``onceflow_gc_watermark_timestamp_seconds{namespace}``         the committed watermark it used
``onceflow_gc_threshold_timestamp_seconds{namespace}``         generations older were forgotten
``onceflow_gc_acked_batch{namespace}``                         the last micro-batch Spark
                                                               committed
=============================================================  ==================================
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from onceflow.kernel.errors import ConfigError
from onceflow.operations.gc_report import REMOVED_KINDS, GcPass, Removed
from onceflow.runtime.driver.exporter import MetricsEndpoint

_MS = 1000.0
_TOTALS = (
    ("passes", "onceflow_gc_passes", "GC passes recorded in Redis for the namespace."),
    ("removed_keys", "onceflow_gc_removed_keys", "Keys GC passes removed."),
    ("removed_bytes", "onceflow_gc_removed_bytes", "Bytes GC passes freed (MEMORY USAGE)."),
)
_TOTAL_FIELDS = frozenset(field for field, _name, _doc in _TOTALS)


@dataclass(frozen=True)
class NamespacePass:
    """One pass over a namespace, and the namespace's GC record in Redis after it."""

    result: GcPass
    totals: Mapping[str, int]
    ended_ms: int


class GcMetrics(MetricsEndpoint, Collector):
    """What the GC passes of this process did, for Prometheus."""

    def __init__(self) -> None:
        self.passes: dict[str, NamespacePass] = {}
        self.success: bool | None = None
        self.ended_ms = 0
        self.failures = 0
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self._server: Any = None

    # -- feeding ------------------------------------------------------------------------

    def passed(self, result: GcPass, record: Mapping[bytes | str, Any]) -> None:
        """A namespace's pass, with its GC record read back from Redis."""
        totals = {_text(k): int(v) for k, v in record.items() if _text(k) in _TOTAL_FIELDS}
        self.passes[result.namespace] = NamespacePass(result, totals, _now_ms())

    def run_ended(self, ok: bool) -> None:
        """A run over every namespace asked for ended (``ok``: without an error)."""
        self.success = ok
        self.ended_ms = _now_ms()
        self.failures = 0 if ok else self.failures + 1

    # -- output -------------------------------------------------------------------------

    def write(self, path: str) -> None:
        """Replace ``path`` (a ``.prom`` file for node-exporter's textfile collector)."""
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            msg = f"--metrics-file {path}: folder {folder} does not exist"
            raise ConfigError(msg)
        write_to_textfile(path, self.registry)

    def collect(self) -> Iterator[Metric]:
        """The metrics of the module docstring."""
        if self.success is not None:
            yield _gauge("onceflow_gc_run_success", "1 if the last run passed.", int(self.success))
            yield _gauge(
                "onceflow_gc_run_timestamp_seconds", "When the last run ended.", self.ended_ms / _MS
            )
            yield _gauge(
                "onceflow_gc_failures_in_a_row",
                "Failed runs since the last good one.",
                self.failures,
            )
        yield from self._totals()
        yield from self._last_passes()

    def _totals(self) -> Iterator[Metric]:
        for field, name, doc in _TOTALS:
            metric = CounterMetricFamily(name, doc, labels=["namespace"])
            for ns, p in sorted(self.passes.items()):
                metric.add_metric([ns], p.totals.get(field, 0))
            yield metric

    def _last_passes(self) -> Iterator[Metric]:
        def family(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"onceflow_gc_{name}", doc, labels=["namespace", *labels])

        when = family("last_pass_timestamp_seconds", "When this process's last pass ended.")
        took = family("last_pass_duration_seconds", "How long the pass took.")
        scanned = family("last_pass_scanned_keys", "Keys the pass scanned.")
        keys = family("last_pass_removed_keys", "Keys the pass removed, by kind.", "kind")
        size = family("last_pass_removed_bytes", "Bytes the pass freed, by kind.", "kind")
        ids = family("last_pass_removed_ids", "Seen IDs the pass forgot.")
        dry = family("last_pass_dry_run", "1 if the pass only looked (--dry-run).")
        horizon = family("horizon_seconds", "The dedup horizon the pass kept.")
        watermark = family("watermark_timestamp_seconds", "The committed watermark it used.")
        threshold = family(
            "threshold_timestamp_seconds", "Generations whose newest event is older were forgotten."
        )
        acked = family("acked_batch", "The last micro-batch Spark committed.")
        for ns, p in sorted(self.passes.items()):
            r = p.result
            when.add_metric([ns], p.ended_ms / _MS)
            took.add_metric([ns], r.seconds)
            scanned.add_metric([ns], r.scanned)
            for kind in sorted({*REMOVED_KINDS, *r.removed}):
                removed = r.removed.get(kind, Removed())
                keys.add_metric([ns, kind], removed.keys or removed.fields)
                size.add_metric([ns, kind], removed.bytes)
            ids.add_metric([ns], r.total.ids)
            dry.add_metric([ns], int(r.dry_run))
            horizon.add_metric([ns], r.horizon_ms / _MS)
            watermark.add_metric([ns], r.watermark / _MS)
            if r.threshold is not None:
                threshold.add_metric([ns], r.threshold / _MS)
            acked.add_metric([ns], r.acked)
        yield from (when, took, scanned, keys, size, ids, dry, horizon, watermark, threshold, acked)


def _gauge(name: str, doc: str, value: float) -> Metric:
    metric = GaugeMetricFamily(name, doc)
    metric.add_metric([], value)
    return metric


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _now_ms() -> int:
    return int(time.time() * 1000)

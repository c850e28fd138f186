"""``onceflow run --metrics-port``: scrape a real run and compare with an independent count.

``tests/e2e_pipelines/orders.py`` reads events produced by the test (some sent twice, a few
undecodable) in a child process. The first run stops after two micro-batches and keeps
serving (``--metrics-linger``); a scrape must then show what the checkpoint says was read,
the duplicates among those records, the outputs, and, against what the test produced, the
lag of each partition. A GC pass and a second run that reads the rest follow.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from onceflow.cli.main import main
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce
from onceflow.dedup.batch import BatchParams
from onceflow.operations.gc_metrics import GcMetrics
from onceflow.operations.gc_report import GcPass, Removed
from onceflow.runtime.driver.exporter import BatchView, RunExporter
from tests.exactly_once.scenario import BASE_TS, EVENTS, PIPELINE, make_scenario, verify
from tests.runtime.child import Child

DASHBOARD = os.path.join(
    os.path.dirname(__file__), "..", "..", "docker", "grafana", "onceflow-dashboard.json"
)
BAD = 7  # undecodable records, at the end of partition 0


def scrape(url):
    """``{(name, frozenset(labels)): value}`` of one scrape."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(found, name, **labels):
    """Sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in found.items() if n == name and want <= lab)


def scrape_when_stopped(run, timeout=600):
    """The run's metrics once its query stopped (it lingers, serving them)."""
    url = run.wait_for(r"metrics: (http://\S+)").group(1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = scrape(url)
        if total(found, "onceflow_run_active") == 0 and total(found, "onceflow_batches_total"):
            return found
        assert run.proc.poll() is None, run.output[-4000:]
        time.sleep(0.5)
    raise AssertionError(f"the run never stopped:\n{run.output[-4000:]}")


def read_ends(scn):
    """Per partition, where the last committed batch ended (Spark's offset log)."""
    folder = os.path.join(scn.workdir, "checkpoint")
    last = max(int(f) for f in os.listdir(os.path.join(folder, "commits")) if f.isdigit())
    with open(os.path.join(folder, "offsets", str(last)), encoding="utf-8") as fh:
        ends = json.loads(fh.read().splitlines()[2])
    return {p: ends.get(f"{scn.topics['in']}:{p}", 0) for p in scn.sent}


@pytest.mark.kafka
@pytest.mark.redis
def test_metrics_of_a_run_match_an_independent_count(broker, redis_server, tmp_path):
    scn = make_scenario(broker, redis_server.url, tmp_path)
    topic = scn.topics["in"]
    produce(
        KafkaSettings(scn.bootstrap),
        topic,
        [(None, b"{not json", None)] * BAD,
        partitions=2,
        partitioner=lambda _n, _key: 0,
    )
    produced = {0: len(scn.sent[0]) + BAD, 1: len(scn.sent[1])}
    serve = ["--metrics-port", "0", "--metrics-linger", "600"]

    # run 1: two micro-batches of at most 1,000 records, then linger
    with Child(["run", PIPELINE, *scn.args, "--stop-after-batches", "2", *serve], scn.env) as run:
        first = scrape_when_stopped(run)
        started = time.monotonic()
        run.signal(signal.SIGTERM)  # ends the lingering
        assert run.wait() == 0, run.output[-4000:]  # (wait gives up after 300 s)
        print(f"SIGTERM to exit 0 while lingering: {time.monotonic() - started:.1f} s")
    ends = read_ends(scn)
    read = {p: scn.sent[p][: ends[p]] for p in scn.sent}
    events = [e for p in read for e in read[p]]
    unique = {e["event_id"] for e in events}
    assert sum(ends.values()) == 2000 and len(events) == 2000, "no undecodable record yet"
    assert total(first, "onceflow_batches_total") == 2
    # counts and event times, not durations: the histogram saw one observation per batch
    assert total(first, "onceflow_batch_duration_seconds_count") == 2
    assert total(first, "onceflow_input_records_total") == 2000
    assert total(first, "onceflow_stage_records_in_total", stage="events") == 2000
    assert total(first, "onceflow_duplicates_dropped_total") == len(events) - len(unique)
    assert total(first, "onceflow_stage_records_out_total", output="copy") == len(unique)
    assert total(first, "onceflow_dead_letters_total") == 0
    assert total(first, "onceflow_bloom_maybe_total", stage="events") >= 0
    for p, n in produced.items():
        labels = {"source": "events", "topic": topic, "partition": str(p)}
        assert total(first, "onceflow_kafka_end_offset", **labels) == ends[p]
        assert total(first, "onceflow_kafka_readable_offset", **labels) == n
        assert total(first, "onceflow_kafka_consumer_lag", **labels) == n - ends[p]
    assert total(first, "onceflow_kafka_consumer_lag") == sum(produced.values()) - 2000
    newest = max(e["ts"] for e in events) / 1000  # event time of the records read
    assert BASE_TS / 1000 <= total(first, "onceflow_watermark_timestamp_seconds") <= newest
    assert total(first, "onceflow_dedup_horizon_seconds") == 24 * 3600  # the configured horizon
    assert total(first, "onceflow_run_info", namespace=scn.name, guarantee="exactly-once") == 1

    # GC passes between the runs; the next run's endpoint tells when
    assert main(["gc", "--namespace", scn.name, "--redis-url", scn.redis_url]) == 0
    gc_ended = time.time()

    # run 2: the rest, including the undecodable records
    with Child(["run", PIPELINE, *scn.args, *serve], scn.env) as run:
        second = scrape_when_stopped(run)
        run.signal(signal.SIGTERM)
        assert run.wait() == 0, run.output[-4000:]
    rest = sum(produced.values()) - 2000
    # records in are those decoded; the undecodable ones are dead letters, with their reason
    assert total(second, "onceflow_input_records_total") == rest - BAD
    assert total(second, "onceflow_dead_letters_total", stage="events", reason="undecodable") == BAD
    assert total(second, "onceflow_dead_letters_total") == BAD
    assert (
        total(first, "onceflow_duplicates_dropped_total")
        + total(second, "onceflow_duplicates_dropped_total")
        == EVENTS * 6 // 100
    )
    assert (
        total(first, "onceflow_stage_records_out_total", output="copy")
        + total(second, "onceflow_stage_records_out_total", output="copy")
        == EVENTS
    )
    assert total(second, "onceflow_kafka_consumer_lag") == 0
    for p, n in produced.items():
        assert total(second, "onceflow_kafka_end_offset", partition=str(p)) == n
    assert abs(total(second, "onceflow_gc_last_pass_timestamp_seconds") - gc_ended) < 60
    verify(scn, redis_server.client())


def exposition_names(text):
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_dashboard_uses_only_metrics_that_exist():
    run = RunExporter("p", "p", "exactly-once", "0", ["src", "sink"])
    run.started(3)
    counters = {
        "src/in": 10,
        "src/out/sink": 9,
        "src/duplicates_dropped": 1,
        "src/dead_letters": 1,
        "src/dead_letters.undecodable": 1,
        "src/bloom_maybe": 2,
        "src/redis_lookups": 2,
        "src/replayed_outputs": 0,
        "src/commit_conflicts": 1,
    }
    params = BatchParams(0, 2_000, 1_000, 1_500, 500, 1, 3, (3, 2), 9_000)
    offsets = {("src", "t", 0): (10, 12)}
    run.observe(BatchView(0, 0.5, 10, counters, params, offsets, 1_000))
    gc = GcMetrics()
    gc.passed(GcPass("p", False, 500, 1_000, 0, 400, removed={"seen_ids": Removed(1)}), {})
    gc.run_ended(True)
    names = exposition_names(generate_latest(run.registry).decode())
    names |= exposition_names(generate_latest(gc.registry).decode())
    with open(DASHBOARD, encoding="utf-8") as fh:
        dashboard = json.load(fh)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs.append(dashboard["templating"]["list"][1]["query"]["query"])
    used = {m for e in exprs for m in re.findall(r"onceflow_[a-z_]+", e)}
    assert used and used <= names, sorted(used - names)
    assert {"onceflow_kafka_consumer_lag", "onceflow_dead_letters_total"} <= used


def test_a_fused_stage_whose_name_holds_a_slash_keeps_its_counters():
    """A sibling-fused stage is named ``<producer>/shuffled``: its counters must show under it,
    not under its producer with the rest of the name taken for the counter's."""
    exporter = RunExporter("p", "p", "exactly-once", "0", ["events", "events/shuffled"])
    counters = {
        "events/in": 10,
        "events/shuffled/in": 7,
        "events/shuffled/out/revenue-out": 5,
        "events/out/events/shuffled": 7,
    }
    exporter.observe(BatchView(batch=0, seconds=1.0, records=10, counters=counters))
    text = generate_latest(exporter.registry).decode()
    found = {
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("stage") is not None
    }
    stages = {dict(labels)["stage"] for _name, labels, _v in found}
    assert stages == {"events", "events/shuffled"}, found
    outputs = {
        (dict(labels)["stage"], dict(labels).get("output"), v)
        for name, labels, v in found
        if name.startswith("onceflow_stage_records_out")
    }
    assert ("events/shuffled", "revenue-out", 5.0) in outputs, outputs
    assert ("events", "events/shuffled", 7.0) in outputs, outputs

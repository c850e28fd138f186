"""``onceflow gc --metrics-file`` (cron) and ``--every --metrics-port``, against real Redis.

The namespace is built by hand (``tests/exactly_once/test_gc.py``), so what a pass must
remove is known without asking GC: 9 generations x 4 shards of 3 seen IDs, 6 backups,
2 batch parameter hashes and 1 Bloom snapshot field.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from onceflow.cli.main import main
from tests.exactly_once.test_gc import MINUTE, _fake_namespace

pytestmark = pytest.mark.redis

SEEN_KEYS, SEEN_IDS, BACKUPS, BATCH_PARAMS, SNAPSHOT_FIELDS = 9 * 4, 9 * 4 * 3, 6, 2, 1


def samples(text):
    """``{(name, frozenset(labels)): value}`` of a Prometheus text exposition."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found, name, **labels):
    return found[(name, frozenset(labels.items()))]


def test_a_cron_pass_writes_a_textfile_of_what_it_did(redis_server, tmp_path):
    client = redis_server.client()
    ns = f"gc-metrics-{uuid.uuid4().hex[:6]}"
    _fake_namespace(client, ns)
    path = tmp_path / "onceflow-gc.prom"
    argv = ["gc", "--namespace", ns, "--redis-url", redis_server.url, "--metrics-file", str(path)]

    assert main(argv) == 0
    found = samples(path.read_text())
    assert value(found, "onceflow_gc_run_success") == 1
    assert value(found, "onceflow_gc_passes_total", namespace=ns) == 1
    removed = {"seen_ids": SEEN_KEYS, "backups": BACKUPS, "batch_params": BATCH_PARAMS}
    for kind, n in removed.items():
        assert value(found, "onceflow_gc_last_pass_removed_keys", namespace=ns, kind=kind) == n
    kind = "bloom_snapshots"
    assert value(found, "onceflow_gc_last_pass_removed_keys", namespace=ns, kind=kind) == 1
    assert value(found, "onceflow_gc_last_pass_removed_ids", namespace=ns) == SEEN_IDS
    assert value(found, "onceflow_gc_removed_keys_total", namespace=ns) == sum(removed.values())
    assert value(found, "onceflow_gc_removed_bytes_total", namespace=ns) > 0
    assert value(found, "onceflow_gc_threshold_timestamp_seconds", namespace=ns) == (
        (89 * MINUTE + 1) / 1000
    )
    assert value(found, "onceflow_gc_horizon_seconds", namespace=ns) == 600
    assert value(found, "onceflow_gc_acked_batch", namespace=ns) == 5

    assert main(argv) == 0  # the next cron run: totals come from Redis, so they go on
    found = samples(path.read_text())
    assert value(found, "onceflow_gc_passes_total", namespace=ns) == 2
    assert value(found, "onceflow_gc_removed_keys_total", namespace=ns) == sum(removed.values())
    for kind in [*removed, "bloom_snapshots"]:  # every kind shows, at 0 when nothing went
        assert value(found, "onceflow_gc_last_pass_removed_keys", namespace=ns, kind=kind) == 0


def test_a_failed_cron_pass_says_so_in_the_textfile(tmp_path, capsys):
    path = tmp_path / "onceflow-gc.prom"
    down = "redis://127.0.0.1:1/0"
    code = main(["gc", "--all", "--redis-url", down, "--metrics-file", str(path)])
    assert code == 1 and "cannot reach Redis" in capsys.readouterr().err
    found = samples(path.read_text())
    assert value(found, "onceflow_gc_run_success") == 0
    assert value(found, "onceflow_gc_failures_in_a_row") == 1


def test_metrics_port_needs_every(capsys):
    assert main(["gc", "--all", "--metrics-port", "0"]) == 2
    assert "--metrics-port needs --every" in capsys.readouterr().err


def test_a_gc_loop_serves_its_metrics(redis_server):
    client = redis_server.client()
    ns = f"gc-metrics-{uuid.uuid4().hex[:6]}"
    _fake_namespace(client, ns)
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceflow", "gc", "--namespace", ns, "--every", "200ms"]
        + ["--redis-url", redis_server.url, "--metrics-port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = json.loads(proc.stdout.readline())["url"]
        passes = 0
        while passes < 4:  # the endpoint follows the passes (the last one may lag)
            line = json.loads(proc.stdout.readline())
            assert line["event"] == "onceflow.gc"
            passes += 1
        with urllib.request.urlopen(url, timeout=10) as response:
            found = samples(response.read().decode())
        assert value(found, "onceflow_gc_passes_total", namespace=ns) >= 3
        assert value(found, "onceflow_gc_removed_keys_total", namespace=ns) == (
            SEEN_KEYS + BACKUPS + BATCH_PARAMS
        )
        assert value(found, "onceflow_gc_run_success") == 1
    finally:
        proc.terminate()
        proc.wait(30)

"""``onceflow state get|scan``, ``testing.keyed_state`` and the live page's ``/state.json``
against a real run's state.

The siblings pipeline (a ``process`` step counting each user's events, a revenue sum per user)
runs on events with copies; the state read back must equal an independent count of the
distinct events: the sum per user, and the process step's count with its state's shape.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import uuid
from collections import Counter
from urllib.error import HTTPError
from urllib.request import urlopen

import pytest

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce
from onceflow.kernel import codec
from onceflow.operations.state_read import key_from_json
from onceflow.operations.ui import serve
from onceflow.testing import keyed_state, run_pipeline
from tests.e2e_pipelines.siblings_run import PIPELINE, siblings_run

pytestmark = [pytest.mark.kafka, pytest.mark.redis]


def state_cli(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "onceflow", "state", *args, "--redis-url", redis_url],
        check=False,
        capture_output=True,
        text=True,
    )


def test_state_scan_and_get_read_what_the_run_committed(broker, redis_server, tmp_path):
    run = siblings_run("state", broker.bootstrap, redis_server.url, tmp_path)
    name, topics = run.name, run.topics
    env = {**run.env, "ALERT_STEP": "every third"}  # a step name may hold spaces
    rng = random.Random(3)
    events = [
        {"event_id": uuid.uuid4().hex, "user": f"u{rng.randrange(6)}", "amount": rng.randrange(100)}
        for _ in range(400)
    ]
    copies = rng.sample(events, 40)
    sent = [{**e, "ts": 1_700_000_000_000 + i} for i, e in enumerate(events + copies)]
    produce(
        KafkaSettings(broker.bootstrap),
        topics["in"],
        [(None, json.dumps(e).encode(), None) for e in sent],
        partitions=4,
    )
    args = [*run.args, "--parallelism", "3"]
    ran = run_pipeline(PIPELINE, args, env=env)
    assert ran.returncode == 0, ran.output[-3000:]

    revenue: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for e in events:
        revenue[e["user"]] += e["amount"]
        count[e["user"]] += 1
    assert keyed_state(redis_server.url, name, "revenue") == dict(revenue)

    third = ["--namespace", name, "--step", "every third"]
    scan = state_cli(redis_server.url, "scan", *third, "--json")
    assert scan.returncode == 0, scan.stderr
    rows = [json.loads(line) for line in scan.stdout.splitlines()]
    counted = {r["key"]: r["state"]["state"]["count"] for r in rows}
    assert counted == dict(count), "the process step's count, as the scan shows it"
    assert {r["partition"] for r in rows} <= {0, 1, 2}
    limited = state_cli(redis_server.url, "scan", *third)
    assert limited.returncode == 0 and len(limited.stdout.splitlines()) == len(count)

    revenue_of = ["get", "--namespace", name, "--step", "revenue", "--key"]
    got = state_cli(redis_server.url, *revenue_of, "u1")
    assert got.returncode == 0 and got.stdout.strip().endswith(f": {revenue['u1']}"), got.stdout
    none = state_cli(redis_server.url, *revenue_of, "x")
    assert none.returncode == 1 and "no state for key 'x'" in none.stdout
    wrong = state_cli(redis_server.url, "scan", "--namespace", name, "--step", "by-user")
    assert wrong.returncode == 2, wrong.stderr
    assert "stateful steps: every third, revenue" in wrong.stderr, wrong.stderr

    server, url = serve(name, redis_server.url, "<svg/>")  # the live page's server
    try:
        page = json.loads(urlopen(f"{url}state.json?step=revenue&limit=1000").read())
        assert {e["key"]: e["state"] for e in page["entries"]} == dict(revenue)
        one = json.loads(urlopen(f"{url}state.json?step=every+third&key=u2").read())["entries"]
        assert [e["state"]["state"]["count"] for e in one] == [count["u2"]]
        with pytest.raises(HTTPError) as refused:
            urlopen(f"{url}state.json?step=by-user")
        assert refused.value.code == 400
    finally:
        server.stop()


def test_keys_given_as_json_are_the_keys_the_state_holds():
    assert key_from_json("7") == 7
    assert key_from_json('"u1"') == "u1"
    assert key_from_json('[["a", 1], 2]') == (("a", 1), 2)
    assert key_from_json('{"hex": "7531"}') == b"u1"
    for key in (7, "u1", (("a", 1), 2), b"u1"):  # what a run stores: the codec's bytes
        assert codec.encode(key_from_json(json.dumps(_json(key)))) == codec.encode(key)


def _json(key):
    if isinstance(key, bytes):
        return {"hex": key.hex()}
    if isinstance(key, tuple):
        return [_json(k) for k in key]
    return key

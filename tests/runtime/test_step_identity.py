"""A step's identity is its own, not the fused stage's (issue 42 item 8).

The optimizer fuses unrelated siblings (an alert step and a revenue sum reading one key
exchange) into one stage. A stage after an exchange keeps all its state (keyed state, seen
IDs, backups) under a hash tag made from the stage's name, so a stage named after one of its
steps moved the *other* steps' state away when that step was renamed: after
``--accept-plan-change`` the revenue started from zero. A fused stage is named after what its
steps share (``events/shuffled``), and renaming the alert step leaves the revenue whole.
"""

from __future__ import annotations

import json
import random
import uuid
from collections import Counter

import pytest

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce, read_topic
from onceflow.operations.status import status
from onceflow.testing.harness import run_pipeline
from tests.e2e_pipelines.siblings_run import PIPELINE, siblings_run

pytestmark = [pytest.mark.kafka, pytest.mark.redis]

BASE_TS = 1_700_000_000_000


def _events(rng: random.Random, n: int) -> list[dict]:
    return [
        {
            "event_id": uuid.uuid4().hex,
            "user": f"u{rng.randrange(5)}",
            "amount": rng.randrange(1, 100),
            "ts": BASE_TS + i,
        }
        for i in range(n)
    ]


def test_renaming_one_fused_step_leaves_the_other_steps_state(broker, redis_server, tmp_path):
    run = siblings_run("siblings", broker.bootstrap, redis_server.url, tmp_path)
    name, topics, env, args = run.name, run.topics, run.env, run.args
    settings = KafkaSettings(broker.bootstrap)
    rng = random.Random(5)
    first, second = _events(rng, 300), _events(rng, 300)
    copies = rng.sample(first, 30)  # sent again after the rename: still copies

    def send(events: list[dict]) -> None:
        produce(settings, topics["in"], [(None, json.dumps(e).encode(), None) for e in events])

    send(first)
    ran = run_pipeline(PIPELINE, args, env=env)
    assert ran.returncode == 0, ran.output[-3000:]
    send(second + copies)
    renamed = {**env, "ALERT_STEP": "alerts"}
    refused = run_pipeline(PIPELINE, args, env=renamed)
    assert refused.returncode != 0 and "--accept-plan-change" in refused.output, refused.output
    assert "'events/shuffled'" in refused.output, "the change names the shared stage"
    ran = run_pipeline(PIPELINE, [*args, "--accept-plan-change"], env=renamed)
    assert ran.returncode == 0, ran.output[-3000:]

    expected: Counter[str] = Counter()
    for e in first + second:
        expected[e["user"]] += e["amount"]
    latest = {}
    for record in read_topic(settings, topics["out"]):  # the key's user, the value its total
        latest[record.key.decode()] = json.loads(record.value)
    assert latest == dict(expected), "the revenue lost what it summed before the rename"
    shown = status(redis_server.client(), name).text()  # a receiver named after no one step
    assert "stage events/shuffled runs alerts -> alerts-out -> revenue -> revenue-out" in shown

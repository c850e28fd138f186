"""The short torture run for CI: three random kill -9s of the whole run, messy input, one
final run, then the independent check (see ``torture.py``; run it longer with
``python -m tests.exactly_once.torture --minutes 10``)."""

from __future__ import annotations

import pytest

from tests.exactly_once.torture import check, torture

pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]


@pytest.mark.parametrize("seed", [11])
def test_random_kills_and_messy_input_lose_and_duplicate_nothing(
    seed, broker, redis_server, tmp_path
):
    # ~10 micro-batches per run, so each run outlasts the latest kill (the kill lands mid-run)
    t = torture(
        broker.bootstrap,
        redis_server.url,
        str(tmp_path),
        seed=seed,
        kills=3,
        wave=1500,
        cap=150,
        max_kill_s=18.0,
    )
    facts = check(t, redis_server.client())
    assert t.kills >= 2, f"the run ended before it could be killed: {facts}"
    assert facts["duplicates_dropped"] > 0 and facts["poison"] > 0

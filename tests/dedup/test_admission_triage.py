"""Admission decides a plain chunk at once, and it decides it as row by row would.

A chunk with no row late or ahead, and either every ID positional or none repeated or known
to the task, is decided for all rows at once (the hot path); every other chunk row by row.
Random chunks with late, ahead, repeated, admitted, earlier and positional rows are decided
both ways wherever the plain way takes them: the same decisions and candidates.
"""

from __future__ import annotations

import random
from typing import Any

from onceflow.dedup import admission
from onceflow.dedup.config import DedupConfig
from onceflow.dedup.session import TaskSession
from onceflow.kernel.keyspace import Keyspace


def _session(rng: random.Random) -> TaskSession:
    config = DedupConfig()
    return TaskSession(
        None,  # type: ignore[arg-type] - triage never calls the store
        Keyspace("p"),
        config,
        "1",
        "s",
        0,
        0,
        floor=rng.choice((0, 5)),
        limit_ms=rng.choice((None, 10 * config.bucket_ms)),
    )


def test_a_plain_chunk_is_decided_at_once_as_row_by_row() -> None:
    plain = 0
    for seed in range(2000):
        rng = random.Random(seed)
        session = _session(rng)
        bucket = session.config.bucket_ms
        pool = [bytes([i]) * 16 for i in range(40)]
        n = rng.randrange(0, 12)
        spread = rng.choice((0, 1))  # sometimes some rows late or ahead
        rows: list[Any] = [
            (0, rng.choice(pool), rng.randrange(5 * bucket - spread, 10 * bucket + spread), None, 1)
            for _ in range(n)
        ]
        kind = rng.random()
        positional = (
            []
            if kind < 0.4
            else [True] * n
            if kind < 0.8
            else [rng.random() < 0.5 for _ in range(n)]
        )
        fingerprints = [rng.randrange(3) for _ in range(n)]
        admitted = {rid: 1 for rid in rng.sample(pool, rng.choice((0, 0, 2)))}
        earlier = frozenset(rng.sample(pool, rng.choice((0, 0, 3))))
        at_once = admission._plain_triage(session, admitted, earlier, rows, positional)
        if at_once is None:
            continue
        plain += 1
        each = admission._triage_each(session, admitted, earlier, rows, positional, fingerprints)
        assert at_once == each, f"seed {seed}"
    assert plain > 500

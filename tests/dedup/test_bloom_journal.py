"""The Bloom journal when a receiver's partitions commit at the same time, and filters caught
up against a Redis that lost writes (issue 26, items 4 and 1).

A source stage's partitions share one receiver: their tasks run at once in different Python
workers, and their commits interleave. ``bench/bloom_journal.py`` ran an hour of such batches
against the real task code: a snapshot had to cover *every* commit of the receiver, which a
task's filters rarely do when it closes (another partition committed meanwhile), so nearly
every snapshot was refused and the journal grew without bound. Here the same interleaving is
made deterministic (each worker's filter cache swapped in for its steps), and a randomized
test checks the guarantee the journal and snapshots exist for: whatever the interleaving of
commits, snapshots and worker restarts, filters never say "new" for a committed ID.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from onceflow.dedup import trust as trust_mod
from onceflow.dedup.bloom import ReceiverFilters, positions
from onceflow.dedup.errors import FiltersAheadError
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.records import TaskRef
from tests.dedup.test_guard import TS, Harness, _copies, _rows
from tests.fixtures.redis import RedisService

pytestmark = pytest.mark.redis

HOUR = 3_600_000


class Workers:
    """Python workers' filter caches (``trust._FILTERS`` is one per process)."""

    def __init__(self, n: int) -> None:
        self.caches: list[dict[Any, ReceiverFilters]] = [{} for _ in range(n)]

    @contextmanager
    def on(self, w: int) -> Iterator[None]:
        """Run the steps inside as worker ``w`` does."""
        saved = trust_mod._FILTERS
        trust_mod._FILTERS = self.caches[w]
        try:
            yield
        finally:
            trust_mod._FILTERS = saved

    def restart(self, w: int) -> None:
        """The worker process died: its filters are gone."""
        self.caches[w] = {}


def _open(h: Harness, partition: int, batch: int, generation: int = 0, live=(1, 0)) -> Any:
    h.attempt_id += 1
    params = replace(h.params(batch, generation), live=tuple(live))
    ref = TaskRef(h.spec.name, batch, partition, 0, h.spec.sinks, h.attempt_id)
    g = h.guards.for_batch(params)(ref)
    g.open()
    return g


def _concurrent_batch(
    h: Harness, workers: Workers, batch: int, chunks: int
) -> tuple[list[bytes], int]:
    """One batch: every partition's task opens, their commits interleave, then they close.

    Partitions move between workers from batch to batch, as Spark hands tasks to whichever
    reused worker is free. Returns the IDs committed and how many tasks reloaded their
    filters from the snapshot (instead of catching up from the journal).
    """
    n = len(workers.caches)
    tasks = []
    for p in range(n):
        w = (p + batch) % n
        with workers.on(w):
            tasks.append((w, _open(h, p, batch)))
    reloads = sum(g.session.counters.get("bloom_loaded_snapshots", 0) for _, g in tasks)
    ids = []
    for c in range(chunks):
        for p, (w, g) in enumerate(tasks):
            rows = _rows(10, (batch * 100 + c) * 10 + p)
            with workers.on(w):
                assert g.commit(c, g.admit(rows).fresh, [], {}, {}) == set()
            ids += [r[1] for r in rows]
    for w, g in tasks:
        with workers.on(w):
            g.close()
    return ids, reloads


@pytest.mark.parametrize(("partitions", "chunks"), [(2, 1), (4, 3)])
def test_the_journal_stays_bounded_while_partitions_commit_at_once(
    redis_server, partitions, chunks
):
    every = 4
    h = Harness(redis_server, snapshot_every=every)
    journal = Keyspace(h.name).filter_journal(h.spec.name)
    workers = Workers(partitions)
    committed: list[bytes] = []
    lengths = []
    reloads = 0
    for batch in range(40):
        ids, reloaded = _concurrent_batch(h, workers, batch, chunks)
        committed += ids
        reloads += reloaded
        lengths.append(h.client.llen(journal))
    # The journal keeps the commits since the snapshot before the last one: two intervals
    # of `every` commits or a little more (a snapshot comes at the end of a task), at most.
    bound = 2 * (every + partitions * chunks)
    assert max(lengths) <= bound, f"journal lengths after each batch: {lengths}"
    # Workers another worker's snapshot overtook still catch up from the journal: reloading
    # the whole snapshot (megabytes) at every snapshot would cost more than the journal saved.
    assert reloads == 0
    for w in [*range(partitions), None]:  # each worker, and a new one
        cache = Workers(1) if w is None else workers
        with cache.on(0 if w is None else w):
            g = _open(h, 0, 1000 + (w or 0), live=(0,))
            adm = g.admit(_copies([(0, i, TS, None, {}) for i in committed], HOUR))
        assert adm.duplicates == len(committed) and not adm.fresh


def _unknown(filters: ReceiverFilters, committed: dict[bytes, int]) -> list[bytes]:
    """Committed IDs the filters of their generation say "certainly not seen" to."""
    missing = []
    for gen in set(committed.values()):
        ids = [i for i, g in committed.items() if g == gen]
        byte, bit = positions(ids, *filters.shape)
        found = np.zeros(len(ids), dtype=bool)
        for f in filters.generations.get(gen, []):
            found |= f.test(byte, bit)
        missing += [i for i, ok in zip(ids, found, strict=True) if not ok]
    return missing


OPS = st.lists(
    st.tuples(
        st.sampled_from(["open", "commit", "commit", "close", "restart"]),
        st.integers(0, 2),  # the worker
        st.integers(0, 1),  # open: the task's generation; commit: whether to send copies
    ),
    min_size=5,
    max_size=45,
)


# Worker 0 snapshots (commit 2) while holding the IDs of its later commit 4 (generation 1) and
# catches up incrementally; worker 1 then snapshots (commit 3) generation 1 from filters
# without commit 4; worker 0's next snapshot (commit 4) must write generation 1 again, or a
# new worker never learns commit 4's IDs (random search rarely finds this).
PREFIX_SNAPSHOT = [
    *(("open", 0, 1), ("commit", 0, 0), ("close", 0, 0), ("open", 0, 1), ("commit", 0, 0)),
    *(("open", 1, 0), ("commit", 1, 0), ("commit", 0, 0), ("close", 0, 0), ("open", 0, 0)),
    *(("close", 1, 0), ("close", 0, 0)),
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, every=st.integers(1, 3))
@example(ops=PREFIX_SNAPSHOT, every=1)
def test_filters_never_say_new_for_a_committed_id_whatever_the_interleaving(
    redis_server, ops, every
):
    """Three workers, three partitions, two generations: random opens, commits (with copies
    of committed IDs), closes (snapshots) and worker restarts. Once a task opened, its filters
    cover every ID committed so far, copies of those are never committed again, and a new
    worker knows every ID.

    Tasks open at the same time may commit into different generations (a run's batches do
    not, but nothing here should depend on it).
    """
    h = Harness(redis_server, snapshot_every=every)
    workers = Workers(3)
    open_tasks: dict[int, tuple[int, Any, list[bytes]]] = {}  # worker -> partition, guard, known
    committed: dict[bytes, int] = {}  # ID -> generation
    rng = np.random.default_rng(len(ops) * 10 + every)
    for step, (op, w, arg) in enumerate(ops):
        with workers.on(w):
            if op == "open" and w not in open_tasks:
                busy = {p for p, _, _ in open_tasks.values()}
                p = min(set(range(3)) - busy)
                g = _open(h, p, step, generation=arg)
                assert g.stage.trusted and not _unknown(g.stage.filters, committed)
                open_tasks[w] = (p, g, list(committed))
            elif op == "commit" and w in open_tasks:
                _, g, known = open_tasks[w]
                _commit(g, step, committed, known, rng, copies=bool(arg))
            elif op == "close" and w in open_tasks:
                open_tasks.pop(w)[1].close()
            elif op == "restart":
                open_tasks.pop(w, None)  # its task dies with it, never closed
                workers.restart(w)
    with Workers(1).on(0):
        g = _open(h, 0, len(ops) + 1)
        assert not _unknown(g.stage.filters, committed)


def _commit(
    g: Any, chunk: int, committed: dict[bytes, int], known: list[bytes], rng: Any, copies: bool
) -> None:
    """One chunk of new IDs and copies of IDs committed before the task opened (``known``).

    The chunk is redone without the IDs its commit reports as conflicts: IDs committed by
    another task since this one opened, caught by the commit's check-and-set.
    """
    rows = _rows(int(rng.integers(1, 6)), int(rng.integers(1 << 30)))
    if copies and known:
        again = [known[int(j)] for j in rng.integers(0, len(known), 3)]
        rows += _copies([(0, i, rows[0][2], None, {}) for i in dict.fromkeys(again)], HOUR)
    fresh = g.admit(rows).fresh
    assert not {r[1] for r in fresh} & set(known), "a copy of a committed ID was admitted"
    while (conflicts := g.commit(chunk, fresh, [], {}, {})) != set():
        fresh = [r for r in fresh if r[1] not in conflicts]
    committed.update((r[1], g.session.generation) for r in fresh)


def test_filters_of_a_redis_that_lost_writes_and_restarted_are_reloaded(redis_factory, tmp_path):
    """A host crash: Redis comes back without a commit it acknowledged, and another commit
    takes its number. A worker whose filters covered the lost commit must not trust them
    (same commit count, other IDs): it reloads them from the restarted server."""
    server = redis_factory(appendfsync="always")
    h = Harness(RedisService(server.url), snapshot_every=1000)
    workers = Workers(2)
    with workers.on(0):
        h.commit(_rows(50, 1))  # commit 1
    server.stop()
    shutil.copytree(server.directory, tmp_path / "disk")  # what the disk will hold
    server.start()
    with workers.on(0):
        h.commit(_rows(50, 2))  # commit 2, acknowledged: worker 0's filters cover it
    server.kill()
    shutil.rmtree(server.directory)
    shutil.copytree(tmp_path / "disk", server.directory)
    server.start()  # without commit 2
    other = _rows(50, 3)
    with workers.on(1):
        h.commit(other, generation=1)  # commit number 2 again, with other IDs
    with workers.on(0):
        g, adm = h.admit(_copies(other, HOUR), generation=2)
    assert adm.duplicates == len(other) and not adm.fresh
    assert g.session.counters.get("bloom_journal_entries") == 2, "reloaded, not trusted"


def test_filters_ahead_of_the_same_redis_instance_stop_the_task(redis_server):
    h = Harness(redis_server, snapshot_every=1000)
    for i in range(3):
        h.commit(_rows(20, 60 + i))
    # Redis drops commits 2 and 3 without restarting (what a same-instance loss would look like)
    h.client.set(Keyspace(h.name).filter_seq(h.spec.name), 1)
    with pytest.raises(FiltersAheadError, match="cover 3 commits but Redis holds 1"):
        h.task()

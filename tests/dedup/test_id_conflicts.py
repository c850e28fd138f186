"""A seen ID with other content is an ID conflict, not a copy (against a real Redis).

A source record's seen-mark holds a checksum of the bytes it was read from. A copy (a
producer's retry, a re-send hours later) carries the same bytes; another record under the
same ID (an app between two pipelines copied one ``onceflow-id`` header onto several
records; an id function naming an entity; an upstream pipeline reset and re-using IDs with
new values) does not, and must not be dropped silently as a copy.
"""

from __future__ import annotations

import pytest

from onceflow.dedup import trust as trust_mod
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.seen_layout import SEEN_MARK
from tests.dedup.test_guard import Harness, _rows

pytestmark = pytest.mark.redis


def _fingerprints(rows, salt=0):
    return [1000 + i + salt for i in range(len(rows))]


def test_a_later_record_with_the_same_id_and_other_bytes_is_a_conflict(redis_server):
    h = Harness(redis_server, snapshot_every=1000)
    rows = _rows(40, 1)
    g = h.task()
    adm = g.admit(rows, (), _fingerprints(rows))
    assert g.commit(0, adm.fresh, [], {}, {}) == set()
    g.close()
    trust_mod._FILTERS.clear()  # settled by Redis, not by this worker's memory
    later = h.task()
    fingerprints = _fingerprints(rows)
    fingerprints[:10] = [7] * 10  # ten records under taken IDs, with other bytes
    adm = later.admit(rows, (), fingerprints)
    assert len(adm.conflicts) == 10 and adm.duplicates == 30 and not adm.fresh
    assert later.session.counters["id_conflicts"] == 10


def test_within_a_chunk_and_within_an_attempt_too(redis_server):
    h = Harness(redis_server, snapshot_every=1000)
    rows = _rows(5, 2)
    g = h.task()
    chunk = rows + [rows[0], rows[1]]  # the same IDs again: one a copy, one another record
    adm = g.admit(chunk, (), [*_fingerprints(rows), 1000, 999])
    assert len(adm.fresh) == 5 and adm.duplicates == 1 and adm.conflicts == [rows[1]]
    assert g.commit(0, adm.fresh, [], {}, {}) == set()
    again = g.admit([rows[2], rows[3]], (), [1002, 5])  # committed by this attempt
    assert again.duplicates == 1 and again.conflicts == [rows[3]]


def test_two_partitions_committing_one_id_with_other_bytes_conflict_on_content(redis_server):
    h = Harness(redis_server, snapshot_every=1000)
    rows = _rows(20, 3)
    a, b = h.task(partition=0, batch=9), h.task(partition=1, batch=9)
    fresh_a = a.admit(rows, (), _fingerprints(rows)).fresh
    fingerprints_b = _fingerprints(rows)
    fingerprints_b[:4] = [1, 2, 3, 4]
    fresh_b = b.admit(rows, (), fingerprints_b).fresh
    assert a.commit(0, fresh_a, [], {}, {}) == set()
    assert b.commit(0, fresh_b, [], {}, {}) == {r[1] for r in rows}
    assert b.conflicting_content() == {r[1] for r in rows[:4]}, "copies taken for conflicts"


def test_marks_without_a_fingerprint_say_nothing_against_a_record(redis_server):
    """Marks an older Onceflow wrote (the constant) and records without bytes stay copies."""
    h = Harness(redis_server, snapshot_every=1000)
    rows = _rows(10, 4)
    g = h.task()
    assert g.commit(0, g.admit(rows).fresh, [], {}, {}) == set()  # no fingerprints: constant marks
    ks = Keyspace(h.name)
    fields = [
        f
        for key in h.client.scan_iter(match=ks.pattern())
        if b":seen:" in key
        for f in h.client.hvals(key)
    ]
    assert set(fields) == {SEEN_MARK}
    trust_mod._FILTERS.clear()
    adm = h.task().admit(rows, (), _fingerprints(rows, salt=50))
    assert adm.duplicates == 10 and not adm.conflicts

"""``onceflow gc`` and ``onceflow status`` against real Redis, Spark and broker.

The unit half builds a namespace by hand and checks what a pass removes and keeps, that it
never forgets a generation a running batch may commit into, and that a commit keeps its
generation's newest event time up to date (the forget script re-checks it). The end-to-end half runs
the orders pipeline with a 20-second horizon over ~50 minutes of event time while GC passes
run concurrently every 200 ms, feeds it duplicates inside and outside the horizon, kills it
once, resumes, and compares against an independent count. (Seen-IDs are forgotten once both
the watermark and the wall clock have moved a horizon past them, so the horizon is short in
wall-clock terms: the run takes about a minute.)
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import uuid
from collections import Counter

import pytest

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import read_topic
from onceflow.dedup.batch import BatchParams
from onceflow.kernel.keyspace import Keyspace, Kind
from onceflow.kernel.scopes import SCOPED_FIELD, read_scopes
from onceflow.kernel.scripts import COMMIT, scripts_for
from onceflow.kernel.seen_layout import LAYOUT, LAYOUT_FIELD
from onceflow.operations.gc import GcError, collect
from onceflow.operations.reset import reset
from onceflow.operations.status import status
from onceflow.testing.harness import Crash, crash_and_resume
from tests.exactly_once.scenario import BASE_TS, PIPELINE, Scenario, produce_sends, verify

MINUTE = 60_000


def _fake_namespace(
    client, name, *, wm_bucket=100, acked=5, bucket_ms=MINUTE, horizon_ms=10 * MINUTE
):
    """Generations 80..100, each with seen-IDs and its newest event time half a bucket in."""
    ks = Keyspace(name)
    client.hset(
        ks.meta,
        mapping={
            "bucket_ms": bucket_ms,
            "horizon_ms": horizon_ms,
            "shards": 4,
            "parallelism": 2,
            LAYOUT_FIELD: LAYOUT,
        },
    )
    wm = wm_bucket * bucket_ms + 1
    for batch in range(acked - 2, acked + 1):  # parameters of the last batches
        live = tuple(range(wm_bucket, wm_bucket - 11, -1))
        params = BatchParams(
            batch, wm, wm, wm, horizon_ms, wm_bucket - 10, wm_bucket, live, wm + 3_600_000
        )
        client.hset(ks.batch(batch), mapping=params.as_fields())
    client.set(ks.acked, acked)
    for bucket in range(80, wm_bucket + 1):
        client.hset(ks.generations, bucket, bucket * bucket_ms + bucket_ms // 2)
        for shard in range(4):
            client.hset(
                ks.seen("stage", bucket, shard),
                mapping={f"id{bucket}-{shard}-{i}": "0.0" for i in range(3)},
            )
    for batch in range(0, 9):
        client.hset(ks.backup("stage", batch, 0), mapping={"c0": b"x" * 100, "done": "1"})
    client.hset(ks.filter_snapshot("stage"), mapping={"seq": 9, "g85": b"y" * 50, "g95": b"z" * 50})
    return ks


def _generations(client, ks):
    return {int(g) for g in client.hkeys(ks.generations)}


def _keys(client, ks, kind):
    return sorted(k.decode() for k in client.scan_iter(match=ks.pattern(kind)))


def test_gc_pass_removes_only_what_can_no_longer_matter(redis_server):
    client = redis_server.client()
    ks = _fake_namespace(client, f"gc-unit-{uuid.uuid4().hex[:6]}")
    before_seen, before_bk = _keys(client, ks, Kind.SEEN), _keys(client, ks, Kind.BACKUP)

    dry = collect(client, ks.namespace, dry_run=True, scan_count=7, delete_batch=3)
    # threshold = wm - horizon - one bucket of slack = 89 minutes + 1 ms: generations whose
    # newest event (half a bucket in) is older go, that is 80..88
    assert dry.threshold == 89 * MINUTE + 1
    assert dry.garbage.forgotten == frozenset(range(80, 89))
    assert dry.removed["seen_ids"].keys == 9 * 4 and dry.removed["seen_ids"].ids == 9 * 4 * 3
    assert dry.removed["backups"].keys == 6  # batches 0..5 (acked = 5)
    assert dry.removed["batch_params"].keys == 2  # batches 3, 4 (5's stay: GC measures from it)
    assert dry.removed["bloom_snapshots"].fields == 1
    assert dry.total.bytes > 0
    assert (
        _keys(client, ks, Kind.SEEN) == before_seen and _keys(client, ks, Kind.BACKUP) == before_bk
    )
    assert _generations(client, ks) == set(range(80, 101)), "a dry run must not forget"

    real = collect(client, ks.namespace, scan_count=7, delete_batch=3)
    assert real.total.keys == dry.total.keys and real.total.ids == dry.total.ids
    left = {int(k.rsplit(":", 2)[1]) for k in _keys(client, ks, Kind.SEEN)}
    assert left == set(range(89, 101))
    assert _generations(client, ks) == set(range(89, 101))
    assert [int(k.rsplit(":", 2)[1]) for k in _keys(client, ks, Kind.BACKUP)] == [6, 7, 8]
    assert set(client.hkeys(ks.filter_snapshot("stage"))) == {b"seq", b"g95"}
    assert client.exists(ks.batch(5)) and not client.exists(ks.batch(4))
    assert int(client.hget(ks.gc, "passes")) == 1

    again = collect(client, ks.namespace)
    assert again.total.keys == 0, "a second pass finds nothing new"


def test_gc_refuses_a_shorter_horizon_and_unknown_namespaces(redis_server):
    client = redis_server.client()
    ks = _fake_namespace(client, f"gc-unit-{uuid.uuid4().hex[:6]}")
    with pytest.raises(GcError, match="shorter than the horizon"):
        collect(client, ks.namespace, horizon="1m")
    longer = collect(client, ks.namespace, horizon="15m", dry_run=True)
    assert longer.garbage.forgotten == frozenset(range(80, 84))
    with pytest.raises(GcError, match="no exactly-once state"):
        collect(client, "no-such-pipeline")


def test_gc_never_forgets_a_generation_a_batch_may_still_commit_into(redis_server):
    """The acknowledged batch's generation (and newer ones) stay, however old their events.

    A batch that is running commits into its own generation, at or past the acknowledged
    batch's. If a pass forgot that generation because the records committed into it so far
    were old, the keys it deletes next could take IDs the batch has just marked seen.
    """
    client = redis_server.client()
    ks = _fake_namespace(client, f"gc-limit-{uuid.uuid4().hex[:6]}")
    client.hset(ks.generations, mapping={100: 1, 101: 1})  # old events only, current and next
    for shard in range(4):
        client.hset(ks.seen("stage", 101, shard), "late-copy", "0.0")
    done = collect(client, ks.namespace)
    assert done.garbage.forgotten == frozenset(range(80, 89))
    assert {100, 101} <= _generations(client, ks)
    assert client.exists(ks.seen("stage", 100, 0)) and client.exists(ks.seen("stage", 101, 3))


def test_a_commit_raises_its_generation_and_a_stale_forget_is_refused(redis_server):
    client = redis_server.client()
    ks = Keyspace(f"gc-fence-{uuid.uuid4().hex[:6]}")
    client.set(ks.epoch, 1)
    client.set(ks.token("s", 0), "1:7")
    keys = [
        ks.epoch,
        ks.token("s", 0),
        ks.backup("s", 0, 0),
        ks.filter_seq("s"),
        ks.filter_journal("s"),
        ks.stats("s"),
        ks.generations,
        ks.lanes,
        ks.lane_activity,
        ks.gc,
        ks.seen("s", 49, 0),
    ]
    run = len(keys).to_bytes(2, "little") + (1).to_bytes(4, "little")  # one field, last key

    def commit(chunk, rid, newest):
        server = ""  # no server check
        args = [1, "1:7", server, b"0.0", chunk, b"", b"", 1, rid, run, 49, newest, newest]
        args += ["", b"", b"", 0, 0, 0, 0]
        # no inputs field, lanes 0, state values 0, timers 0, stats 0
        return client.eval(COMMIT, len(keys), *keys, *args)

    assert commit("c0", b"r" * 16, 5_000)[0] == b"ok"
    assert int(client.hget(ks.generations, 49)) == 5_000
    assert commit("c1", b"q" * 16, 3_000)[0] == b"ok"
    assert int(client.hget(ks.generations, 49)) == 5_000, "the newest event time never drops"
    assert commit("c2", b"r" * 16, 9_000)[0] == b"conflict"
    assert int(client.hget(ks.generations, 49)) == 5_000, "a refused chunk changes nothing"
    # GC decided with an older view (newest 5000 < 6000), but a commit raised it meanwhile
    assert commit("c3", b"p" * 16, 7_000)[0] == b"ok"
    forget = scripts_for(client).forget_generation
    assert forget(keys=[ks.generations], args=[49, 6_000]) == 0
    assert forget(keys=[ks.generations], args=[49, 7_001]) == 1
    assert client.hget(ks.generations, 49) is None


def _fake_scopes(client, ks, stage="agg", parallelism=2):
    """Partition scopes of ``stage`` beside the fake namespace, with the same kinds of keys."""
    client.hset(ks.meta, SCOPED_FIELD, json.dumps([stage]))
    scopes = read_scopes(client, ks)
    for p, scope in enumerate(scopes.partition_keyspaces()):
        for bucket in range(80, 101):
            client.hset(scope.generations, bucket, bucket * MINUTE + MINUTE // 2)
            client.hset(scope.seen(stage, bucket, 0), f"id{bucket}-{p}", "0.0")
        for batch in range(0, 9):
            client.hset(scope.backup(stage, batch, p), mapping={"c0": b"x" * 10, "done": "1"})
        client.hset(scope.stats(stage), mapping={"in": 10 + p, "duplicates": 1})
        client.hset(scope.state("count", p), f"user{p}", 1)
    return scopes


def test_gc_status_and_reset_cover_every_partition_scope(redis_server, tmp_path):
    client = redis_server.client()
    ks = _fake_namespace(client, f"gc-scopes-{uuid.uuid4().hex[:6]}")
    scopes = _fake_scopes(client, ks)
    seen = status(client, ks.namespace)
    assert seen.receivers["agg"] == {"in": 21, "duplicates": 2}, "summed over partitions"
    assert seen.state["count"]["keys"] == 2
    assert seen.backups_pending == 3 + 2 * 3 and seen.backups_garbage == 6 + 2 * 6
    done = collect(client, ks.namespace)
    assert done.removed["seen_ids"].keys == 9 * 4 + 2 * 9
    assert done.removed["backups"].keys == 6 + 2 * 6
    for p, scope in enumerate(scopes.partition_keyspaces()):
        left = {int(k.rsplit(":", 2)[1]) for k in _keys(client, scope, Kind.SEEN)}
        assert left == set(range(89, 101)), f"partition {p}"
        assert _generations(client, scope) == set(range(89, 101))
        assert client.hget(scope.state("count", p), f"user{p}") == b"1", "state is not garbage"
    gone = reset(client, ks.namespace, None)
    assert gone.keys > 0
    assert not list(client.scan_iter(match=f"of:{{{ks.namespace}*")), "reset left keys behind"


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "onceflow", *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_gc_and_status_refuse_a_namespace_an_older_onceflow_made_in_one_line(redis_server):
    client = redis_server.client()
    ks = _fake_namespace(client, f"gc-old-{uuid.uuid4().hex[:6]}")
    client.hset(ks.meta, LAYOUT_FIELD, 2)
    url = redis_server.url
    for command in ("gc", "status"):
        out = _cli(command, "--namespace", ks.namespace, "--redis-url", url)
        assert out.returncode == 2, out.stdout + out.stderr
        assert out.stderr.strip() == (
            f"error: namespace {ks.namespace!r} was made by an older version of onceflow "
            f"(seen-ID layout 2): run `onceflow reset --namespace {ks.namespace} --checkpoint "
            "CHECKPOINT_DIR --yes` to start it over (its dedup history, backups and keyed "
            "state go), or use onceflow 0.1.0 at commit 7c48c6f, the last that reads it"
        )
    assert client.exists(ks.seen("stage", 80, 0)), "GC deleted nothing"
    good = _fake_namespace(client, f"gc-new-{uuid.uuid4().hex[:6]}")
    both = ("--namespace", ks.namespace, "--namespace", good.namespace, "--redis-url", url)
    out = _cli("status", *both)
    assert out.returncode == 2 and "older version of onceflow" in out.stderr
    assert good.namespace in out.stdout, "the old namespace hid the others"


def test_gc_and_status_commands(redis_server):
    client = redis_server.client()
    ks = _fake_namespace(client, f"gc-cli-{uuid.uuid4().hex[:6]}")
    url = redis_server.url
    dry = _cli("gc", "--namespace", ks.namespace, "--dry-run", "--redis-url", url)
    assert dry.returncode == 0, dry.stderr
    line = json.loads(dry.stdout.strip().splitlines()[-1])
    assert line["event"] == "onceflow.gc" and line["dry_run"] and line["removed_keys"] == 44
    assert client.exists(ks.seen("stage", 80, 0))
    shown = _cli("status", "--namespace", ks.namespace, "--json", "--redis-url", url)
    assert shown.returncode == 0, shown.stderr
    (st,) = json.loads(shown.stdout)
    assert st["backups_pending"] == 3 and st["backups_garbage"] == 6 and st["memory_bytes"] > 0
    real = _cli("gc", "--namespace", ks.namespace, "--redis-url", url)
    assert json.loads(real.stdout.strip().splitlines()[-1])["removed_keys"] == 44
    text = _cli("status", "--namespace", ks.namespace, "--redis-url", url)
    assert "backups pending 3 (acknowledged, awaiting GC: 0)" in text.stdout
    missing = _cli("gc", "--namespace", "nope-not-here", "--redis-url", url)
    assert missing.returncode != 0 and "check the namespace" in missing.stderr
    down = _cli("gc", "--all", "--redis-url", "redis://127.0.0.1:1/0")
    assert down.returncode != 0 and "Check REDIS_URL" in down.stderr


# -- end to end ------------------------------------------------------------------------------

EVENTS = 3000
STEP_MS = 1000  # 3000 events over 50 minutes of event time; 1000 per micro-batch ~ 17 minutes


def _gc_scenario(broker, redis_url, tmp_path, seed=11):
    rng = random.Random(seed)
    name = f"gc-{uuid.uuid4().hex[:8]}"
    scn = Scenario(
        name,
        broker.bootstrap,
        redis_url,
        str(tmp_path),
        Counter(),
        set(),
        # copies below are re-sent up to ~100 records after (or before) their original:
        # the out-of-orderness covers that, the horizon is short in wall-clock terms
        {"ORDERS_HORIZON": "20s", "ORDERS_BUCKET": "5s", "ORDERS_OUT_OF_ORDER": "3m"},
    )
    events = [
        {
            "event_id": str(uuid.uuid4()),
            "user": f"u{rng.randrange(13)}",
            "ts": BASE_TS + STEP_MS * i,
        }
        for i in range(EVENTS)
    ]
    scn.expected = Counter(e["user"] for e in events)
    scn.unique_ids = {e["event_id"] for e in events}
    sends = [(e, i % 2) for i, e in enumerate(events)]
    # inside the horizon: re-sent a few records later (seconds of event time apart)
    inside = rng.sample(events[: EVENTS - 10], 120)
    for e in inside:
        pos = events.index(e) + rng.randrange(1, 10)
        sends.insert(pos, (e, rng.randrange(2)))
    # outside: events of the first 20 minutes re-sent at the very end (30+ minutes later)
    outside = rng.sample(events[:1200], 80)
    sends += [(e, rng.randrange(2)) for e in outside]
    produce_sends(scn, sends)
    return scn, len(inside), len(outside)


class GcLoop:
    """GC passes every ``interval`` seconds in a thread, as ``onceflow gc --every`` would."""

    def __init__(self, client, namespace, interval=0.2):
        self.client, self.namespace, self.interval = client, namespace, interval
        self.passes = []
        self.errors = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            try:
                self.passes.append(collect(self.client, self.namespace, scan_count=200))
            except GcError:
                pass  # the pipeline has not created its namespace yet
            except Exception as exc:  # noqa: BLE001
                self.errors.append(repr(exc))
            self.stop.wait(self.interval)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)


@pytest.mark.crash
@pytest.mark.kafka
def test_gc_concurrent_with_a_crashing_pipeline_loses_and_duplicates_nothing(
    broker, redis_server, tmp_path
):
    client = redis_server.client()
    scn, inside, outside = _gc_scenario(broker, redis_server.url, tmp_path)
    with GcLoop(client, scn.name) as gc:
        first, second = crash_and_resume(
            PIPELINE, Crash("batch_end", batch=1), scn.args, env=scn.env
        )
    assert first.crashed and second.returncode == 0
    assert not gc.errors, gc.errors
    # nothing lost, nothing counted or written twice
    verify(scn, client)
    removed = Counter()
    for p in gc.passes:
        for kind, r in p.removed.items():
            removed[kind] += r.keys
    assert removed["seen_ids"] > 0 and removed["backups"] > 0, (
        f"GC never removed anything: {removed}"
    )
    # copies inside the horizon were dropped as duplicates; copies outside it could no longer
    # be recognised and went to the dead-letter topic with their reason (not processed twice)
    stats = {
        k.decode(): int(v) for k, v in client.hgetall(Keyspace(scn.name).stats("events")).items()
    }
    from onceflow.connectors.kafka.sink import ERROR_HEADER

    dead = read_topic(KafkaSettings(broker.bootstrap), f"{scn.name}.dead-letters")
    late_ids = [
        json.loads(json.loads(r.value)["value"])["event_id"]
        for r in dead
        if b"dedup horizon" in r.headers.get(ERROR_HEADER, b"")
    ]
    # (a copy counts as late once the watermark has moved 20 seconds past it; copies read
    # before that are still recognised as duplicates)
    assert len(late_ids) == stats["late"] > 0
    assert stats["duplicates"] + stats["late"] == inside + outside
    assert set(late_ids) <= {e for e in scn.unique_ids}
    # status agrees with what happened
    st = status(client, scn.name)
    assert st.receivers["events"]["in"] == EVENTS + inside + outside
    assert st.backups_pending <= 2 * 4  # at most the last batch's (stages x partitions)
    assert st.generations, "status shows the generations kept"
    assert any(p.garbage.forgotten for p in gc.passes), "GC never forgot a generation"


@pytest.mark.parametrize("collected", [False, True], ids=["no-gc", "after-gc"])
def test_a_horizon_raised_after_gc_turns_copies_of_deleted_ids_into_late_records(
    redis_server, collected
):
    """GC deleted the seen-IDs below its threshold; a horizon raised afterwards must not
    admit copies of those records as new (they become late dead letters instead). Without
    GC, the raised horizon finds them as duplicates."""
    from onceflow.dedup import trust as trust_mod
    from onceflow.dedup.batch import fix_batch_params
    from onceflow.dedup.config import DedupConfig
    from onceflow.dedup.guard import ExactlyOnceGuards
    from onceflow.kernel.eventtime import EventTime
    from onceflow.kernel.records import TaskRef
    from onceflow.kernel.settings import RedisSettings
    from tests.dedup.test_guard import _copies, _rows, _spec

    hour = 3_600_000
    client = redis_server.client()
    name = f"gc-raise-{uuid.uuid4().hex[:6]}"
    ks = Keyspace(name)
    client.incr(ks.epoch)
    client.hset(ks.meta, mapping={"bucket_ms": hour, "horizon_ms": hour, LAYOUT_FIELD: LAYOUT})
    spec = _spec(name)
    start = (int(client.time()[0]) * 1000 // hour - 10) * hour  # 10 h ago, a bucket's start
    short, long = (DedupConfig(bucket_ms=hour, horizon_ms=h * hour) for h in (1, 24))

    def guard(config, params, attempt):
        g = ExactlyOnceGuards(RedisSettings(redis_server.url), name, 1, config).for_batch(params)
        g = g(TaskRef(spec.name, params.batch, 0, 0, spec.sinks, attempt))
        g.open()
        return g

    def ran(batch, watermark):
        """Parameters of a batch that ran with the 1 h horizon, in the watermark's bucket."""
        bucket = watermark // hour
        return BatchParams(
            batch, watermark, watermark, watermark, hour, bucket - 1, bucket, (bucket,), 2 * start
        )

    rows = [(p, rid, start + i, kb, e) for i, (p, rid, _ts, kb, e) in enumerate(_rows(200, 3))]
    g = guard(short, ran(0, start), 1)
    assert g.commit(0, g.admit(rows).fresh, [], {}, {}) == set()
    g.close()
    later = ran(5, start + 4 * hour)  # batches 1..5 moved the watermark 4 h on
    client.hset(ks.batch(5), mapping=later.as_fields())
    client.set(ks.acked, 5)
    if collected:
        assert start // hour in collect(client, name).garbage.forgotten
    client.hset(ks.meta, "horizon_ms", 24 * hour)  # the operator raises the horizon
    client.hset(ks.lanes, mapping={"t:0": start + 4 * hour})
    client.hset(ks.lane_activity, mapping={"t:0": start + 4 * hour})
    params = fix_batch_params(client, ks, 1, 6, long, EventTime())
    trust_mod._FILTERS.clear()
    adm = guard(long, params, 2).admit(_copies(rows, 60_000))
    if collected:
        assert len(adm.late) == len(rows) and not adm.fresh
    else:
        assert adm.duplicates == len(rows) and not adm.fresh


def test_gc_deleting_while_a_batch_with_a_raised_horizon_runs_admits_no_copy(
    redis_server, monkeypatch
):
    """The race the check in the commit is for: a batch fixed its parameters with a raised
    horizon (it looks up an old generation) while a GC pass that had read the namespace
    before deleted that generation. The batch's copies of records in it are no longer found;
    the commit refuses them (they are older than GC's floor), and admitted again they are
    late: dead letters, never counted twice."""
    from onceflow.dedup import trust as trust_mod
    from onceflow.dedup.batch import fix_batch_params
    from onceflow.dedup.commit import FloorRaised
    from onceflow.dedup.config import DedupConfig
    from onceflow.dedup.guard import ExactlyOnceGuards
    from onceflow.kernel.eventtime import EventTime
    from onceflow.kernel.records import TaskRef
    from onceflow.kernel.settings import RedisSettings
    from onceflow.operations import gc as gc_module
    from tests.dedup.test_guard import _copies, _rows, _spec

    hour = 3_600_000
    client = redis_server.client()
    name = f"gc-race-{uuid.uuid4().hex[:6]}"
    ks = Keyspace(name)
    client.incr(ks.epoch)
    client.hset(ks.meta, mapping={"bucket_ms": hour, "horizon_ms": hour, LAYOUT_FIELD: LAYOUT})
    spec = _spec(name)
    start = (int(client.time()[0]) * 1000 // hour - 10) * hour
    short, long = (DedupConfig(bucket_ms=hour, horizon_ms=h * hour) for h in (1, 24))

    def guard(config, params, attempt):
        g = ExactlyOnceGuards(RedisSettings(redis_server.url), name, 1, config).for_batch(params)
        g = g(TaskRef(spec.name, params.batch, 0, 0, spec.sinks, attempt))
        g.open()
        return g

    def ran(batch, watermark):
        bucket = watermark // hour
        return BatchParams(
            batch, watermark, watermark, watermark, hour, bucket - 1, bucket, (bucket,), 2 * start
        )

    rows = [(p, rid, start + i, kb, e) for i, (p, rid, _ts, kb, e) in enumerate(_rows(200, 4))]
    g = guard(short, ran(0, start), 1)
    assert g.commit(0, g.admit(rows).fresh, [], {}, {}) == set()
    g.close()
    later = ran(5, start + 4 * hour)
    client.hset(ks.batch(5), mapping=later.as_fields())
    client.set(ks.acked, 5)
    client.hset(ks.meta, "horizon_ms", 24 * hour)  # the driver restarts with a longer horizon
    client.hset(ks.lanes, mapping={"t:0": start + 4 * hour})
    client.hset(ks.lane_activity, mapping={"t:0": start + 4 * hour})
    params = fix_batch_params(client, ks, 1, 6, long, EventTime())
    assert start // hour in params.live, "the raised horizon looks the old generation up"
    # GC had read the namespace before batch 6 and the new horizon existed: it still deletes
    # by the short horizon (what it read), after the batch fixed its parameters
    real_read = gc_module.read_batch_params
    monkeypatch.setattr(
        gc_module, "read_batch_params", lambda c, k, b: None if b == 6 else real_read(c, k, b)
    )
    monkeypatch.setattr(
        gc_module, "read_meta", lambda c, k: {"bucket_ms": str(hour), "horizon_ms": str(hour)}
    )
    assert start // hour in collect(client, name).garbage.forgotten
    trust_mod._FILTERS.clear()
    task = guard(long, params, 2)
    copies = _copies(rows, 60_000)
    adm = task.admit(copies)
    assert len(adm.fresh) == len(rows), "GC took the originals' seen-IDs: the copies look new"
    with pytest.raises(FloorRaised):
        task.commit(0, adm.fresh, [], {}, {})
    task.raise_floor(_gc_floor(client, ks))
    again = task.admit(copies)
    assert len(again.late) == len(rows) and not again.fresh


def _gc_floor(client, ks):
    from onceflow.kernel.keyspace import GC_FLOOR_FIELD

    return int(client.hget(ks.gc, GC_FLOOR_FIELD))

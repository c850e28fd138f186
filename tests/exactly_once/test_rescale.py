"""Rescale with state and savepoints: a pipeline's parallelism changed between runs, its state
moved to another Redis, under kill -9.

``tests/e2e_pipelines/orders.py`` (a non-deterministic map, a copy topic, a count per user in
keyed state, a counts topic) runs at parallelism 4, then 7 (the run rescales itself, and is
killed -9 inside a micro-batch; a rescale asked while that batch is in flight is refused), then
2 (``onceflow rescale`` killed -9 while staging and while switching, a third finishing it);
then a savepoint is taken and restored on another Redis under another namespace (each killed
-9 at a random moment and run again) and the restored pipeline rescales to 3 and runs to the
end. Copies of events already counted are sent again across every change. ``verify`` compares
the keyed state, every emission of the counts topic (batch by batch, from Spark's offset log)
and the copy topic with an independent count of the input: nothing lost, nothing counted twice.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import redis

from onceflow.kernel.key_hash import exchange_partition
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.scopes import node_keyspaces, read_scopes
from onceflow.kernel.seen_layout import seen_id
from onceflow.runtime.driver.rescale_staging import Layout, scope_shards
from onceflow.testing.harness import Crash, run_pipeline
from onceflow.testing.services import LocalRedis
from tests.exactly_once.scenario import (
    PIPELINE,
    cli_killed_then_done,
    make_scenario,
    onceflow_cli,
    produce_sends,
    run_args,
    verify,
)

pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]


def _args(scn, parallelism, *extra):
    return [*scn.args, "--parallelism", str(parallelism), *extra]


def _rescale_cli(scn, parallelism, kill_after_line=None):
    """``onceflow rescale``; killed -9 (its whole session) after a line containing the text."""
    return onceflow_cli(
        "rescale", "--namespace", scn.name, "--parallelism", str(parallelism),
        "--redis-url", scn.redis_url, kill_after_line=kill_after_line,
    )  # fmt: skip


def _resend(scn, rng, n):
    """Copies of ``n`` events already sent, on either partition, after everything else."""
    sent = [e for events in scn.sent.values() for e in events]
    produce_sends(scn, [(e, rng.randrange(2)) for e in rng.sample(sent, n)])


def _check_placement(client, scn, parallelism, namespace=None):
    """Every key's state is in the partition the exchange sends it to; no scope left over."""
    namespace = namespace or scn.name
    scopes = read_scopes(client, Keyspace(namespace))
    assert scopes.parallelism == parallelism
    for p, ks in enumerate(node_keyspaces(client, namespace, "count")):
        for field in client.hkeys(ks.state("count", p)):
            assert exchange_partition(field, parallelism) == p, (field, p)
    wanted = {ks.tag for ks in scopes.partition_keyspaces()}
    found = {
        k.decode().split("}")[0][len("of:{") :] for k in client.scan_iter(f"of:{{{scn.name}:*")
    }
    assert found <= wanted, f"scopes of another parallelism left: {sorted(found - wanted)}"


def _seen_ids(client, scn):
    """Per partition of the count stage: the (receiver, generation, ID) of its seen-IDs."""
    home = Keyspace(scn.name)
    scopes = read_scopes(client, home)
    shards = scope_shards(Layout(int(client.hget(home.meta, "shards")), 0), scopes.parallelism)
    out = []
    for p in range(scopes.parallelism):
        ks = scopes.keyspace("count", p)
        ids = set()
        for key in client.scan_iter(ks.seen_pattern()):
            q = ks.parse(key)
            ids |= {(q.name, q.generation, seen_id(f, q.shard, shards)) for f in client.hkeys(key)}
        out.append(ids)
    return out


def test_rescale_up_and_down_under_kill_9_keeps_every_count(broker, redis_server, tmp_path):
    scn = make_scenario(broker, redis_server.url, tmp_path)
    client = redis_server.client()
    rng = random.Random(11)
    # 4 partitions: two micro-batches, a clean stop
    run_pipeline(PIPELINE, _args(scn, 4, "--stop-after-batches", "2"), env=scn.env).check()
    _resend(scn, rng, 150)
    before = set().union(*_seen_ids(client, scn))
    assert before, "the count stage marked IDs seen"
    # another parallelism without --rescale: refused in one line, nothing moved
    refused = run_pipeline(PIPELINE, _args(scn, 7), env=scn.env)
    assert refused.returncode not in (0, None) and "pass --rescale" in refused.output
    assert "Traceback" not in refused.output, refused.output[-2000:]
    assert read_scopes(client, Keyspace(scn.name)).parallelism == 4
    # 7: the run moves the state itself, then is killed -9 in the count stage of batch 3
    crash = Crash("after_commit", stage="count", batch=3)
    first = run_pipeline(PIPELINE, _args(scn, 7, "--rescale"), env=scn.env, crash=crash)
    assert first.crashed, first.output[-3000:]
    assert "rescaling" in first.output and "to 7 partitions" in first.output
    _check_placement(client, scn, 7)
    after = _seen_ids(client, scn)
    assert all(before <= ids for ids in after), "a partition lost seen-IDs in the move"
    # batch 3 is in flight: another parallelism is refused, in one line, before any write
    code, said = _rescale_cli(scn, 5)
    assert code != 0 and "micro-batch 3 in flight" in said and "Traceback" not in said, said
    run_pipeline(PIPELINE, _args(scn, 7, "--stop-after-batches", "1"), env=scn.env).check()
    _resend(scn, rng, 150)
    # 2: onceflow rescale killed -9 while staging, then while switching; a third finishes it
    before = set().union(*_seen_ids(client, scn))
    for cut in ("partition 1 of 2 staged", "scope 1 of 2 switched"):  # staging, switching
        code, said = _rescale_cli(scn, 2, kill_after_line=cut)
        assert cut in said, said
        assert client.hget(Keyspace(scn.name).meta, "rescaling") is not None
    code, said = _rescale_cli(scn, 2)
    assert code == 0 and "finishing the rescale" in said and "rescaled" in said, said
    _check_placement(client, scn, 2)
    assert all(before <= ids for ids in _seen_ids(client, scn)), "seen-IDs lost in the move"
    assert client.hget(Keyspace(scn.name).meta, "rescaling") is None
    # a savepoint (its create killed -9 at a random moment, then taken), restored on another
    # Redis under another namespace (killed -9, then restored): the restored pipeline, asked
    # for 3 partitions, rescales and runs to the end; copies re-sent before it are dropped
    folder = str(tmp_path / "savepoint")
    checkpoint = os.path.join(scn.workdir, "checkpoint")
    create = ["savepoint", "create", "--namespace", scn.name, "--checkpoint", checkpoint,
              "--to", folder, "--redis-url", scn.redis_url]  # fmt: skip
    cli_killed_then_done(create, rng)
    with LocalRedis() as other:
        copy, restored = f"{scn.name}-copy", str(tmp_path / "restored")
        restore = ["savepoint", "restore", "--from", folder, "--namespace", copy,
                   "--checkpoint", os.path.join(restored, "checkpoint"), "--redis-url",
                   other.url]  # fmt: skip
        cli_killed_then_done(restore, rng)
        _resend(scn, rng, 150)
        args = run_args(scn, other.url, restored, 3, "--rescale", "--namespace", copy)
        last = run_pipeline(PIPELINE, args, env=scn.env).check()
        assert "rescaled" in last.output and "duplicates dropped" in last.output, last.output
        moved = redis.Redis.from_url(other.url)
        _check_placement(moved, scn, 3, namespace=copy)
        verify(dataclasses.replace(scn, workdir=restored), moved, namespace=copy)
    assert not client.exists(Keyspace(scn.name).driver), "the original was never run again"

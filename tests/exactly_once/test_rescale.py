"""Rescale with state: a pipeline's parallelism changed between runs, under kill -9.

``tests/e2e_pipelines/orders.py`` (a non-deterministic map, a copy topic, a count per user in
keyed state, a counts topic) runs at parallelism 4, then 7 (the run rescales itself, and is
killed -9 inside a micro-batch; a rescale asked while that batch is in flight is refused), then
2 (``onceflow rescale`` killed -9 in the middle of its move, the run resuming the move). Copies
of events already counted are sent again across both changes. ``verify`` compares the keyed
state, every emission of the counts topic (batch by batch, from Spark's offset log) and the
copy topic with an independent count of the input: nothing lost, nothing counted twice.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from onceflow.kernel.key_hash import exchange_partition
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.scopes import node_keyspaces, read_scopes
from onceflow.kernel.seen_layout import seen_id
from onceflow.runtime.driver.rescale_staging import Layout, scope_shards
from onceflow.testing.harness import Crash, kill_session, run_pipeline
from tests.exactly_once.scenario import PIPELINE, make_scenario, produce_sends, verify

pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]


def _args(scn, parallelism, *extra):
    return [*scn.args, "--parallelism", str(parallelism), *extra]


def _rescale_cli(scn, parallelism, kill_after_line=None):
    """``onceflow rescale``; killed -9 (its whole session) after a line containing the text."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceflow", "rescale", "--namespace", scn.name,
         "--parallelism", str(parallelism), "--redis-url", scn.redis_url],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if kill_after_line and kill_after_line in line:
            kill_session(proc.pid)
            break
    code = proc.wait(120)
    return code, "".join(lines)


def _resend(scn, rng, n):
    """Copies of ``n`` events already sent, on either partition, after everything else."""
    sent = [e for events in scn.sent.values() for e in events]
    produce_sends(scn, [(e, rng.randrange(2)) for e in rng.sample(sent, n)])


def _check_placement(client, scn, parallelism):
    """Every key's state is in the partition the exchange sends it to; no scope left over."""
    scopes = read_scopes(client, Keyspace(scn.name))
    assert scopes.parallelism == parallelism
    for p, ks in enumerate(node_keyspaces(client, scn.name, "count")):
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
    # 2: onceflow rescale killed -9 after its first partition; the run resumes the move
    before = set().union(*_seen_ids(client, scn))
    for cut in ("partition 1 of 2 staged", "scope 1 of 2 switched"):  # staging, switching
        code, said = _rescale_cli(scn, 2, kill_after_line=cut)
        assert cut in said, said
        assert client.hget(Keyspace(scn.name).meta, "rescaling") is not None
    last = run_pipeline(PIPELINE, _args(scn, 2, "--rescale"), env=scn.env).check()
    assert "rescaled" in last.output, last.output[-3000:]
    _check_placement(client, scn, 2)
    assert all(before <= ids for ids in _seen_ids(client, scn)), "seen-IDs lost in the move"
    assert client.hget(Keyspace(scn.name).meta, "rescaling") is None
    verify(scn, client)
    assert os.path.isdir(os.path.join(scn.workdir, "checkpoint"))

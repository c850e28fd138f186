"""Savepoints: a stopped pipeline's state to a folder and back, on another Redis, exactly once.

``tests/e2e_pipelines/orders.py`` (a non-deterministic map, a copy topic, a count per user in
keyed state, a counts topic) runs two micro-batches at parallelism 3; a savepoint is taken
(``onceflow savepoint create``, killed -9 at a random moment and run again), restored into
another namespace on another Redis (``restore``, killed -9 at a random moment and run again);
copies of counted events are re-sent, and the restored pipeline runs to the end. ``verify``
compares its keyed state, every emission of the counts topic (batch by batch, from the
restored checkpoint's offset log) and the copy topic with an independent count of the input.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import socket
import time

import msgpack
import pytest
import redis

from onceflow.kernel.errors import ConfigError
from onceflow.kernel.scopes import Scopes
from onceflow.operations import savepoint
from onceflow.testing.harness import run_pipeline
from onceflow.testing.services import LocalRedis
from tests.exactly_once.scenario import (
    PIPELINE,
    cli_killed_then_done,
    make_scenario,
    produce_sends,
    run_args,
    verify,
)

pytestmark = [pytest.mark.crash, pytest.mark.kafka, pytest.mark.redis]


# CI time: the default suite takes a savepoint and restores it on another Redis inside
# test_rescale.py's round; this one, on its own, runs with --long.
@pytest.mark.long
def test_a_savepoint_restored_on_another_redis_continues_exactly_once(
    broker, redis_server, tmp_path
):
    scn = make_scenario(broker, redis_server.url, tmp_path / "a")
    rng = random.Random(5)
    os.makedirs(tmp_path / "a", exist_ok=True)
    first = run_args(scn, redis_server.url, scn.workdir, 3, "--stop-after-batches", "2")
    run_pipeline(PIPELINE, first, env=scn.env).check()
    sent = [e for events in scn.sent.values() for e in events]
    produce_sends(scn, [(e, rng.randrange(2)) for e in rng.sample(sent, 150)])
    folder = str(tmp_path / "savepoint")
    create = ["create", "--namespace", scn.name, "--checkpoint",
              os.path.join(scn.workdir, "checkpoint"), "--to", folder,
              "--redis-url", redis_server.url]  # fmt: skip
    cli_killed_then_done(["savepoint", *create], rng)
    manifest = savepoint.read_manifest(folder)
    assert manifest["namespace"] == scn.name and manifest["parallelism"] == 3
    assert not [n for n in os.listdir(tmp_path) if ".partial-" in n] or os.path.isdir(folder)
    with LocalRedis() as other:
        copy = f"{scn.name}-copy"
        restored = tmp_path / "b"
        os.makedirs(restored)
        restore = ["restore", "--from", folder, "--namespace", copy, "--checkpoint",
                   str(restored / "checkpoint"), "--redis-url", other.url]  # fmt: skip
        cli_killed_then_done(["savepoint", *restore], rng)
        assert not os.path.exists(restored / "checkpoint" / savepoint.RESTORING)
        produce_sends(scn, [(e, rng.randrange(2)) for e in rng.sample(sent, 150)])
        args = run_args(scn, other.url, str(restored), 3, "--namespace", copy)
        last = run_pipeline(PIPELINE, args, env=scn.env).check()
        assert "duplicates dropped" in last.output
        restored_redis = redis.Redis.from_url(other.url)
        verify(dataclasses.replace(scn, workdir=str(restored)), restored_redis, namespace=copy)


def test_a_create_cut_short_leaves_no_savepoint_and_a_damaged_one_is_refused(
    redis_server, tmp_path, monkeypatch
):
    """Without Spark: a namespace's keys of every type, written and read back byte for byte."""
    client = redis_server.client()
    ns, checkpoint = "sp-unit", tmp_path / "cp"
    (checkpoint / "commits").mkdir(parents=True)
    (checkpoint / "commits" / "0").write_text("v1\n{}\n")
    client.hset(f"of:{{{ns}}}:meta", mapping={"parallelism": 2, "scoped_stages": '["s"]'})
    many = {f"k{i}".encode(): b"\x01" for i in range(2500)}
    scope = Scopes(ns, frozenset(["s"]), 2).keyspace("s", 1)
    client.hset(scope.state("s", 1), mapping=many)
    client.zadd(scope.timers("event", "s", 1), {b"k1": 5, b"k2": 7})
    client.rpush(f"of:{{{ns}}}:fj:events", b"a", b"b", b"c")
    client.set(f"of:{{{ns}}}:epoch", 4)
    gone = {"host": socket.gethostname(), "pid": 2**22 + 9}  # a driver killed -9 on this host
    client.set(f"of:{{{ns}}}:driver", json.dumps(gone), px=60_000)  # left out
    real = msgpack.packb
    calls = []

    def crash_midway(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(*a, **k)

    monkeypatch.setattr(msgpack, "packb", crash_midway)
    with pytest.raises(OSError):
        savepoint.create(client, ns, str(tmp_path / "sp"), str(checkpoint))
    assert not (tmp_path / "sp").exists(), "no savepoint from a create cut short"
    monkeypatch.setattr(msgpack, "packb", real)
    time.sleep(0.01)
    report = savepoint.create(client, ns, str(tmp_path / "sp"), str(checkpoint))
    assert report.keys == 5 and report.records > 5, "a big hash takes several records"
    savepoint.restore(client, str(tmp_path / "sp"), "sp-back", str(tmp_path / "cp2"))

    def contents(namespace):
        out = {}
        for key in client.scan_iter(f"of:{{{namespace}*"):
            rest = key.decode().split("}", 1)[1]
            kind = client.type(key)
            out[rest] = {
                b"hash": client.hgetall,
                b"string": client.get,
                b"list": lambda k: client.lrange(k, 0, -1),
                b"zset": lambda k: client.zrange(k, 0, -1, withscores=True),
            }[kind](key)
        return out

    before, after = contents(ns), contents("sp-back")
    assert set(before) - set(after) == {":driver"}, "everything but the heartbeat"
    meta = after.pop(":meta")
    assert meta[b"checkpoint"] == str(tmp_path / "cp2").encode()
    assert json.loads(meta[b"scoped_stages"]) == ["s"]
    before.pop(":meta")
    before.pop(":driver", None)
    assert after == before
    assert (tmp_path / "cp2" / "commits" / "0").read_text() == "v1\n{}\n"
    with pytest.raises(ConfigError, match="holds a pipeline"):
        savepoint.restore(client, str(tmp_path / "sp"), "sp-back", str(tmp_path / "cp3"))
    data = tmp_path / "sp" / savepoint.DATA
    blob = data.read_bytes()
    data.write_bytes(blob[:-1] + bytes([blob[-1] ^ 0xFF]))  # one byte changed
    with pytest.raises(ConfigError, match="does not match its manifest's checksum"):
        savepoint.read_manifest(str(tmp_path / "sp"))

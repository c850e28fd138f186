"""``onceflow compact``: small Parquet files merged without losing or doubling a row.

A compaction killed -9 at each of its steps, then run again; and compactions run over and over
beside a pipeline that is itself killed -9 mid-delivery and resumed (one of those killed -9 at
a random moment, if it has not ended by then). A reader that knows nothing of Onceflow
(pyarrow's dataset) must then see every event once, each in its user's folder, in fewer files.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading
import uuid
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from onceflow.backup.store import acknowledge
from onceflow.kernel.keyspace import Keyspace
from onceflow.operations.compaction import WORK, compact
from onceflow.sinks import Parquet
from onceflow.testing.harness import Crash, crash_and_resume, kill_session
from tests.exactly_once.scenario import make_scenario

STEPS = ["write", "manifest", "rename", "delete 0", "delete 2", "forget"]
PIPELINE = str(Path(__file__).resolve().parents[1] / "e2e_pipelines" / "files_orders.py")


def files(root: str) -> list[str]:
    """The sink's data files (hidden folders left out), relative to ``root``."""
    out = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith("_")]
        out += [os.path.relpath(os.path.join(folder, n), root) for n in names]
    return sorted(out)


def ids_in(root: str) -> Counter[str]:
    table = ds.dataset(root, format="parquet", partitioning="hive").to_table()
    return Counter(table.column("_onceflow_id").to_pylist())


def a_sink_folder(root: str, batches: int) -> set[str]:
    """Files as the Parquet sink names them: two user folders, one file per batch and
    partition; the IDs written."""
    written = set()
    for user in ("u1", "u2"):
        os.makedirs(os.path.join(root, f"user={user}"))
        for batch in range(batches):
            for partition in (0, 1):
                rid = [uuid.uuid4().hex for _ in range(3)]
                written |= set(rid)
                name = f"part-{batch:06d}-{partition:05d}-files-{uuid.uuid4().hex[:16]}.parquet"
                table = pa.table({"event_id": rid, "n": [batch] * 3, "_onceflow_id": rid})
                pq.write_table(table, os.path.join(root, f"user={user}", name))
    return written


KILLED_AT = """
import os, signal, sys
import redis
from onceflow.operations.compaction import compact
from onceflow.sinks import Parquet

def crash(step):
    if step == sys.argv[4]:
        os.kill(os.getpid(), signal.SIGKILL)

compact(redis.Redis.from_url(sys.argv[1]), sys.argv[2], "files", Parquet(sys.argv[3]), crash=crash)
"""


@pytest.mark.redis
@pytest.mark.parametrize("step", STEPS)
def test_a_compaction_killed_at_each_step_is_finished_by_the_next(step, redis_server, tmp_path):
    root = str(tmp_path / "out")
    written = a_sink_folder(root, batches=6)
    namespace = f"compact-{uuid.uuid4().hex[:8]}"
    client = redis_server.client()
    acknowledge(client, Keyspace(namespace), 3)  # batches 0..3 committed, 4 and 5 may retry
    late = [f for f in files(root) if re.search(r"part-00000[45]-", f)]
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AT, redis_server.url, namespace, root, step],
        check=False,
        capture_output=True,
    )
    assert killed.returncode == -9, killed.stderr.decode()
    assert set(ids_in(root)) == written, "a row went missing after the kill"

    done = compact(client, namespace, "files", Parquet(root))
    # the manifest is the intent: before it, the staged file is dropped, no merge to finish
    assert done.finished == (step not in ("write", "manifest")), done
    counts = ids_in(root)
    assert set(counts) == written and max(counts.values()) == 1, "a row lost or doubled"
    kept = files(root)
    assert set(late) <= set(kept), "a file of a batch that may still retry was merged"
    merged = [f for f in kept if "compacted-" in f]
    assert len(merged) == 2 and len(kept) == 2 + len(late), kept  # one per user folder
    assert os.listdir(os.path.join(root, WORK)) == [".lock"], "the compaction left work"


@pytest.mark.crash
@pytest.mark.kafka
@pytest.mark.redis
def test_compactions_beside_a_run_killed_mid_delivery_keep_every_event_once(
    broker, redis_server, tmp_path
):
    scn = make_scenario(broker, redis_server.url, tmp_path, resent_percent=6)
    out = os.path.join(str(tmp_path), "files")
    scn.extra_env.update(PARQUET_OUT=out, FILES_FORMAT="parquet")
    env = {**os.environ, **scn.env, "REDIS_URL": redis_server.url}
    args = [a if a != "1000" else "250" for a in scn.args]  # many micro-batches, many files
    reports: list[str] = []
    stop = threading.Event()
    rng = random.Random(11)

    def compact_over_and_over() -> None:
        cmd = [sys.executable, "-m", "onceflow", "compact", PIPELINE]
        kill_one = rng.randrange(3, 8)  # this one is killed -9 at a random moment
        n = 0
        while not stop.is_set():
            n += 1
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                text, _ = proc.communicate(timeout=rng.uniform(0.5, 3.0) if n == kill_one else 120)
                reports.append(text.decode(errors="replace"))
            except subprocess.TimeoutExpired:
                kill_session(proc.pid)
                proc.communicate()
                reports.append("killed")
            stop.wait(0.3)

    thread = threading.Thread(target=compact_over_and_over, daemon=True)
    thread.start()
    try:
        crash = Crash("after_sink_write", stage="events", batch=5, partition=1)
        first, second = crash_and_resume(PIPELINE, crash, args, env=scn.env)
    finally:
        stop.set()
        thread.join(180)
    assert first.crashed and second.returncode == 0, second.output[-2000:]
    final = subprocess.run(
        [sys.executable, "-m", "onceflow", "compact", PIPELINE],
        env=env,
        check=False,
        capture_output=True,
        text=True,
    )
    assert final.returncode == 0, final.stdout + final.stderr

    table = ds.dataset(out, format="parquet", partitioning="hive").to_table().to_pylist()
    ids = Counter(r["event_id"] for r in table)
    assert set(ids) == scn.unique_ids, "an event is missing"
    assert max(ids.values()) == 1, f"{sum(ids.values()) - len(ids)} events written twice"
    assert Counter(r["user"] for r in table) == scn.expected, "an event in the wrong folder"
    merged = [r for r in reports if re.search(r"\b[1-9]\d* file\(s\) of micro-batches", r)]
    assert merged, f"no compaction merged anything while the pipeline ran: {reports}"
    after = files(out)
    users = {f.split("/")[0] for f in after}
    assert len(users) == len(scn.expected), after
    merged = [f for f in after if "/compacted-" in f]
    assert len(merged) == len(users), f"one merged file per user folder: {after}"
    parts = [re.search(r"/part-(\d+)-(\d+)-", f) for f in after if "/part-" in f]
    newest = {}
    for m in parts:
        newest[m.group(2)] = max(newest.get(m.group(2), ""), m.group(1))
    left = {(m.group(1), m.group(2)) for m in parts}
    assert all(batch == newest[p] for batch, p in left), f"only each partition's newest: {left}"


@pytest.mark.redis
def test_only_this_sinks_final_files_merge_and_a_cut_manifest_is_dropped(redis_server, tmp_path):
    root = str(tmp_path / "out")
    written = a_sink_folder(root, batches=4)
    other = os.path.join(root, "user=u1", "part-000001-00000-elsewhere-00aa.parquet")
    pq.write_table(pa.table({"_onceflow_id": ["x"]}), other)  # another sink, same folder
    os.makedirs(os.path.join(root, WORK))
    with open(os.path.join(root, WORK, "abc.json.tmp"), "wb"):
        pass  # a manifest cut while written (kill -9, power loss)
    namespace = f"compact-{uuid.uuid4().hex[:8]}"
    acknowledge(redis_server.client(), Keyspace(namespace), 3)  # every batch committed
    done = compact(redis_server.client(), namespace, "files", Parquet(root, compression="zstd"))
    kept = files(root)
    assert os.path.relpath(other, root) in kept, "another sink's file was merged"
    newest = [f for f in kept if "part-000003-" in f]
    assert len(newest) == 4, f"each partition's newest delivery must stay: {kept}"
    merged = [f for f in kept if "compacted-" in f]
    assert len(merged) == 2 and done.merged == 12, (done, kept)
    codec = pq.ParquetFile(os.path.join(root, merged[0])).metadata.row_group(0).column(0)
    assert codec.compression == "ZSTD", "the sink's compression"
    counts = ids_in(root)
    assert set(counts) == written | {"x"} and max(counts.values()) == 1
    assert os.listdir(os.path.join(root, WORK)) == [".lock"]

"""SIGTERM and SIGINT stop a streaming run between micro-batches, and it resumes exactly.

``tests/e2e_pipelines/orders.py`` runs with a processing-time trigger (a stream that would
never end by itself) in a child process; a signal goes to its driver mid-stream. The run must
finish the micro-batch under way and exit 0; a rerun processes the rest, and the outputs are
compared with an independent count of the input (``tests/exactly_once/scenario.py``).
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.exactly_once.scenario import PIPELINE, batches_read, make_scenario, verify
from tests.runtime.child import Child

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.crash]


SLOW = {"ORDERS_SLOW_MS": "8"}  # ~4 s a micro-batch of 1,000 on two tasks
INTO_BATCH_S = 1.5  # after batch 0's line: batch 1 has started, and is far from done


def streaming_args(scn, cap=1000):
    """The scenario's arguments as an endless stream (no --available-now), ``cap`` a batch."""
    args = [a for a in scn.args if a != "--available-now"]
    at = args.index("--max-records-per-batch")
    args[at + 1] = str(cap)
    return ["run", PIPELINE, *args, "--trigger-seconds", "0.5"]


def summary_rows(lines):
    """The stage names of the summary table's rows, in order (``count  34  17  0  0``)."""
    row = re.compile(r"^(\S+)\s+[\d,]+\s+[\d,]+\s+[\d,]+\s+[\d,]+$")
    return [m.group(1) for line in lines if (m := row.match(line))]


def committed_batches(scn):
    folder = os.path.join(scn.workdir, "checkpoint", "commits")
    return sorted(int(f) for f in os.listdir(folder) if f.isdigit())


def sigterm_to_the_driver(run):
    run.signal(signal.SIGTERM)  # what docker stop and Kubernetes send to PID 1


def sigterm_to_the_process_group(run):
    # kill -TERM -PGID, a supervisor stopping the group: Spark's JVM runs in a group of its
    # own, so it does not die mid-batch (issue 42: ~90 lines of Java and Python tracebacks)
    os.killpg(run.proc.pid, signal.SIGTERM)


def ctrl_c(run):
    os.killpg(run.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole process group


@pytest.mark.parametrize(
    "send",
    [
        sigterm_to_the_process_group,
        pytest.param(sigterm_to_the_driver, marks=pytest.mark.long),
        pytest.param(ctrl_c, marks=pytest.mark.long),
    ],
    ids=lambda f: f.__name__,
)
def test_a_signal_finishes_the_batch_exits_0_and_a_rerun_resumes_exactly(
    send, broker, redis_server, tmp_path
):
    scn = make_scenario(broker, redis_server.url, tmp_path)
    with Child(streaming_args(scn), env={**scn.env, **SLOW}) as run:
        run.wait_for(r"\] batch 0: ")
        time.sleep(INTO_BATCH_S)
        send(run)  # batch 1 is under way
        code = run.wait()
    assert code == 0, run.output[-4000:]
    assert "Traceback" not in run.output and "Exception" not in run.output, run.output[-4000:]
    notice = next(i for i, line in enumerate(run.lines) if ": finishing the current" in line)
    assert any("] batch 1: " in line for line in run.lines[notice:]), "batch 1 finished"
    assert f"pipeline '{scn.name}'" in run.output  # the summary of a normal end
    rows = summary_rows(run.lines)  # issue 29: first rows printed twice after a Ctrl-C?
    assert rows == ["events", "count"], run.output[-4000:]
    assert sum(line.startswith("stage ") for line in run.lines) == 1
    done = committed_batches(scn)
    assert done and done[-1] >= 1
    assert "onceflow: stop requested" not in run.output
    read = sum(len(events) for events in batches_read(scn).values())
    assert 0 < read < sum(len(sent) for sent in scn.sent.values()), "stopped mid-stream"
    reported = [line for line in run.lines if "] batch " in line]
    assert len(reported) == len(done), "every batch that ran was committed"

    rerun = Child(["run", PIPELINE, *scn.args], env=scn.env)
    assert rerun.wait() == 0, rerun.output[-4000:]
    assert "replayed from backup" not in rerun.output, "no batch was cut short"
    verify(scn, redis_server.client())


@pytest.mark.long  # an abort mid-batch is what the crash suite's kill -9 tests prove already
def test_a_second_signal_aborts_and_exactly_once_still_holds(broker, redis_server, tmp_path):
    scn = make_scenario(broker, redis_server.url, tmp_path, seed=11)
    with Child(streaming_args(scn), env={**scn.env, **SLOW}) as run:
        run.wait_for(r"\] batch 0: ")
        time.sleep(INTO_BATCH_S)
        run.signal(signal.SIGINT)
        run.wait_for(r"SIGINT: finishing the current micro-batch")
        run.signal(signal.SIGINT)
        code = run.wait()
    assert code == 130, run.output[-4000:]
    assert "interrupted" in run.output

    rerun = Child(["run", PIPELINE, *scn.args], env=scn.env)
    assert rerun.wait() == 0, rerun.output[-4000:]
    verify(scn, redis_server.client())

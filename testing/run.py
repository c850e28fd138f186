"""``run_test``: run a user's pipeline on test inputs and get what each sink received.

The pipeline is the one you deploy, Kafka sources and sinks included: :func:`run_test`
replaces each source by a :class:`~onceflow.testing.teststream.TestStream` (given in
``inputs`` by source stage name; a list of elements becomes one micro-batch followed by a
watermark advance to the end, so every window that ended closes), each sink by a collecting
sink, and the dead-letter sink by one too. Nothing needs Kafka, and nothing needs a Redis
of yours:

* ``mode="memory"`` (default) runs it in this process with the in-process evaluator
  (:mod:`onceflow.testing.evaluator`): no JVM, milliseconds per test;
* ``mode="spark"`` runs it as a real exactly-once streaming query on local Spark, with a
  Redis server started for the run (:class:`~onceflow.testing.services.LocalRedis`) unless
  ``redis_url`` names one (the run's namespace is deleted from it after). Seconds per test;
  what the evaluator is checked against.

>>> out = run_test(pipeline, {"orders": [{"order_id": 1, "customer": "c1", "amount": 5}]})
>>> assert_that(out["revenue-out"]).contains_exactly([("c1", 5)])
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from onceflow.connectors.collect import Collect
from onceflow.connectors.collections import Collection
from onceflow.graph_optimizer.ir import Graph, Node, Sink, Source
from onceflow.graph_optimizer.lower import lower
from onceflow.graph_optimizer.optimizer import RULES, optimize
from onceflow.kernel import codec
from onceflow.runtime.spark_env.session import DEFAULT_MASTER
from onceflow.testing.errors import TestInputError
from onceflow.testing.evaluator import Evaluator
from onceflow.testing.teststream import TestStream

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from onceflow.graph_optimizer.plan import Plan
    from onceflow.pipeline.api import Pipeline
    from onceflow.runtime.driver.result import RunResult
    from onceflow.runtime.spec import Job

MODES = ("memory", "spark")


@dataclass
class TestOutputs(Mapping[str, list[Any]]):
    """What each sink stage received (by sink stage name), the dead letters, the run's result.

    Elements are as the sink got them: ``(key, value)`` tuples from keyed streams,
    ``(key, Pane)`` from windowed combines. Dead letters are dictionaries with ``stage``,
    ``error``, ``origin``, ``code``, ``ts``, ``id`` and, when known, ``value``.
    """

    __test__ = False  # not a pytest test class

    sinks: dict[str, list[Any]]
    dead_letters: list[dict[str, Any]]
    result: RunResult
    mode: str = "memory"
    watermarks: list[int] = field(default_factory=list)

    def __getitem__(self, sink: str) -> list[Any]:
        try:
            return self.sinks[sink]
        except KeyError:
            names = ", ".join(repr(n) for n in self.sinks) or "none"
            msg = f"no sink stage named {sink!r}; this pipeline's sink stages are: {names}"
            raise KeyError(msg) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.sinks)

    def __len__(self) -> int:
        return len(self.sinks)


def run_test(
    pipeline: Pipeline,
    inputs: Mapping[str, TestStream | Iterable[Any]] | None = None,
    *,
    mode: str = "memory",
    rules: Iterable[Callable[[Plan], Plan]] | None = None,
    start_time_ms: int | None = None,
    session: SparkSession | None = None,
    redis_url: str | None = None,
    master: str = DEFAULT_MASTER,
    parallelism: int = 2,
    workdir: str | None = None,
) -> TestOutputs:
    """Run ``pipeline`` on ``inputs`` (see the module docstring) and return what sinks got.

    ``inputs`` maps source stage names to a :class:`TestStream` or a list of elements; a
    ``sources.Collection`` needs none (its items are used). ``rules`` picks optimizer rules
    as :meth:`Pipeline.run` does. ``start_time_ms`` sets the in-process batch clock's start
    (default: now). ``session``, ``redis_url``, ``master``, ``parallelism`` and ``workdir``
    (checkpoint and outputs; default a temporary folder, removed after) apply to
    ``mode="spark"``.
    """
    if mode not in MODES:
        msg = f"mode must be 'memory' or 'spark', got {mode!r}"
        raise TestInputError(msg)
    sinks: dict[str, Collect] = {}
    dead = Collect()
    job = job_for_test(pipeline, inputs or {}, sinks, dead, rules)
    if mode == "memory":
        evaluator = Evaluator(job, start_time_ms=start_time_ms)
        result = evaluator.run()
        watermarks = evaluator.watermarks
    else:
        result = _run_on_spark(job, session, redis_url, master, parallelism, workdir)
        watermarks = []
    return TestOutputs(
        {name: list(sink.results) for name, sink in sinks.items()},
        list(dead.results),
        result,
        mode,
        watermarks,
    )


def job_for_test(
    pipeline: Pipeline,
    inputs: Mapping[str, TestStream | Iterable[Any]],
    sinks: dict[str, Collect],
    dead: Collect,
    rules: Iterable[Callable[[Plan], Plan]] | None = None,
) -> Job:
    """The pipeline's job with test streams for sources and collecting sinks (into ``sinks``)."""
    graph = pipeline.graph
    source_names = [n.name for n in graph.nodes if isinstance(n, Source)]
    unknown = sorted(set(inputs) - set(source_names))
    if unknown:
        msg = (
            f"inputs name {', '.join(map(repr, unknown))}, which are not source stages of "
            f"pipeline {pipeline.name!r}; its sources are: {', '.join(map(repr, source_names))}"
        )
        raise TestInputError(msg)
    nodes: list[Node] = []
    for node in graph.nodes:
        if isinstance(node, Source):
            stream = _stream_for(node, inputs.get(node.name))
            nodes.append(replace(node, connector=stream, label=stream.describe()))
        elif isinstance(node, Sink):
            sinks[node.name] = Collect()
            nodes.append(replace(node, connector=sinks[node.name], label="collect (test)"))
        else:
            nodes.append(node)
    plan = optimize(Graph(graph.name, tuple(nodes)), tuple(RULES if rules is None else rules))
    return lower(
        plan,
        on_error=pipeline.on_error,
        max_record_bytes=pipeline.max_record_bytes,
        dead_letters=dead,
        dedup=pipeline.dedup,
        event_time=pipeline.event_time,
    ).with_dead_letters(dead)


def _stream_for(node: Source, given: TestStream | Iterable[Any] | None) -> TestStream:
    """The test stream standing in for a source, with the source's id/timestamp functions."""
    connector = node.connector
    id_fn = getattr(connector, "id_fn", None)
    ts_fn = getattr(connector, "ts_fn", None)
    if given is None:
        if not isinstance(connector, Collection):
            msg = (
                f"source stage {node.name!r} ({connector.describe()}) has no test input; pass "
                f"inputs={{{node.name!r}: [...]}} (a list of elements or a TestStream)"
            )
            raise TestInputError(msg)
        given = [codec.decode(item) for item in connector.encoded]
    if isinstance(given, TestStream):
        return given.with_defaults(id_fn, ts_fn)
    if isinstance(given, str | bytes | dict):
        msg = (
            f"the input of source stage {node.name!r} must be a list of elements or a "
            f"TestStream, got a single {type(given).__name__}; wrap it in a list"
        )
        raise TestInputError(msg)
    return TestStream(id=id_fn, timestamp=ts_fn).add(given).advance_watermark_to_end()


def _run_on_spark(
    job: Job,
    session: SparkSession | None,
    redis_url: str | None,
    master: str,
    parallelism: int,
    workdir: str | None,
) -> RunResult:
    """A real exactly-once streaming run of ``job`` (available-now), on local Spark."""
    from onceflow.runtime.driver.run_config import RunConfig
    from onceflow.runtime.driver.streaming import run_streaming

    own_dir = workdir is None
    folder = workdir or tempfile.mkdtemp(prefix="onceflow-test-")
    namespace = f"{job.pipeline}-test-{uuid.uuid4().hex[:8]}"
    try:
        with _redis(redis_url) as url:
            clock_file = _clock_file(folder, url, namespace)
            for _, stream in job.sources:
                stream.clock_file = clock_file
            try:
                config = RunConfig(
                    master=master,
                    parallelism=parallelism,
                    progress=False,
                    output_dir=os.path.join(folder, "out"),
                    checkpoint=os.path.join(folder, "checkpoint"),
                    redis_url=url,
                    namespace=namespace,
                    available_now=True,
                )
                return run_streaming(job, config, session)
            finally:
                if redis_url is not None:  # a Redis of yours keeps no test state
                    _forget(url, namespace)
    finally:
        if own_dir:
            shutil.rmtree(folder, ignore_errors=True)


def _forget(redis_url: str, namespace: str) -> None:
    """Delete the test run's namespace (as ``onceflow reset`` does)."""
    from onceflow.kernel.settings import RedisSettings, redis_client
    from onceflow.operations.reset import reset

    settings = RedisSettings.from_env(redis_url)
    reset(
        redis_client(settings, namespace),
        namespace,
        None,
        connect=lambda tag: redis_client(settings, tag),  # partition scopes on a cluster
    )


def _clock_file(folder: str, redis_url: str, namespace: str) -> str:
    """Where clock steps find the run's Redis (readable by this user only)."""
    path = os.path.join(folder, "teststream-clock.json")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"redis_url": redis_url, "namespace": namespace}, fh)
    return path


@contextmanager
def _redis(url: str | None) -> Iterator[str]:
    """``url``, or a Redis server started for the run (and removed after)."""
    if url is not None:
        yield url
        return
    from onceflow.testing.services import LocalRedis

    server = LocalRedis().start()
    try:
        yield server.url
    finally:
        server.stop()
        shutil.rmtree(server.directory, ignore_errors=True)

"""The package's layers run one way, with no cycles (see ``layers.py`` for the rules)."""

from __future__ import annotations

from tests.architecture.layers import Edge, cycles, edges, modules, violations


def test_every_folder_is_a_layered_package():
    from tests.architecture.layers import SURFACE, layer_of

    unplaced = [m for m in modules() if m not in SURFACE and layer_of(m) is None]
    assert not unplaced, f"modules outside every layer: {unplaced}"


def test_imports_run_down_the_layers():
    found = violations(edges())
    assert not found, "layer violations:\n" + "\n".join(found)


def test_no_import_cycles():
    assert not cycles(edges())


def test_a_reversed_import_is_caught():
    """The rule can fail: the kernel importing the runtime is reported."""
    graph = [
        *edges(),
        Edge("onceflow.kernel.ids", "onceflow.runtime.task.loop", ("TaskRun",), "x:1"),
    ]
    assert any(
        "onceflow.kernel.ids (lower) imports onceflow.runtime" in v for v in violations(graph)
    )


def test_siblings_and_private_names_and_the_surface_are_caught():
    graph = [
        Edge("onceflow.dedup.guard", "onceflow.connectors.base", ("TaskInfo",), "a:1"),
        Edge("onceflow.runtime.task.loop", "onceflow.runtime.ops.body", ("_hidden",), "b:2"),
        Edge("onceflow.pipeline.api", "onceflow", ("Pipeline",), "c:3"),
    ]
    found = "\n".join(violations(graph))
    assert "sibling layer onceflow.connectors" in found
    assert "private ['_hidden']" in found
    assert "imports the root package" in found


def test_a_cycle_is_caught():
    graph = [
        Edge("onceflow.runtime.task.loop", "onceflow.runtime.ops.body", (), "a:1"),
        Edge("onceflow.runtime.ops.body", "onceflow.runtime.task.loop", (), "b:1"),
    ]
    assert cycles(graph)


def test_the_runtime_rooms_are_kept():
    """The rule can fail: a task reaching the driver, an operator reaching the exactly-once
    machinery or the task loop, and a shared module reaching a room are each reported."""
    graph = [
        Edge("onceflow.runtime.task.loop", "onceflow.runtime.driver.compile", (), "a:1"),
        Edge("onceflow.runtime.ops.body", "onceflow.dedup.commit", (), "b:1"),
        Edge("onceflow.runtime.ops.process", "onceflow.runtime", ("task",), "c:1"),
        Edge("onceflow.runtime.spec", "onceflow.runtime.ops.body", (), "d:1"),
        Edge("onceflow.runtime.driver.compile", "onceflow.runtime.task.loop", (), "e:1"),
        Edge("onceflow.runtime.driver.observe", "onceflow.connectors.kafka.offsets", (), "f:1"),
    ]
    found = "\n".join(violations(graph))
    assert "a:1: onceflow.runtime.task.loop (room onceflow.runtime.task)" in found
    assert (
        "b:1: onceflow.runtime.ops.body (room onceflow.runtime.ops) imports onceflow.dedup" in found
    )
    assert "c:1" in found and "imports onceflow.runtime.task" in found
    assert "d:1" in found
    assert "e:1" not in found  # the driver may import the task room
    assert "f:1" in found and "imports onceflow.connectors.kafka.offsets" in found

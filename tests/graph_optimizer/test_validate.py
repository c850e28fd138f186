from __future__ import annotations

import pytest

from onceflow.graph_optimizer.errors import (
    CycleError,
    DuplicateStageError,
    GraphError,
    NoSinkError,
    NotKeyedError,
    UnknownInputError,
)
from onceflow.graph_optimizer.ir import (
    Combine,
    Exchange,
    FlatMap,
    Graph,
    Phase,
    Sink,
    Source,
    validate,
)
from onceflow.pipeline import Pipeline, sinks, sources
from onceflow.pipeline.combiners import Sum
from onceflow.pipeline.errors import PipelineError


def _src(name="src"):
    return Source(name, (), connector=sources.Collection([1]))


def _sink(name, inp):
    return Sink(name, (inp,), connector=sinks.Collect())


def _map(name, *inputs):
    return FlatMap(name, inputs, fn=lambda x: (x,))


def test_valid_graph_is_returned_in_topological_order():
    g = Graph("p", (_sink("out", "a"), _map("a", "src"), _src()))
    assert [n.name for n in validate(g).nodes] == ["src", "a", "out"]


def test_duplicate_names_are_named_in_the_error():
    g = Graph("p", (_src(), _map("a", "src"), _map("a", "src"), _sink("o", "a")))
    with pytest.raises(DuplicateStageError, match="stage 'a' is declared twice"):
        validate(g)


def test_api_rejects_duplicates_when_declared():
    p = Pipeline("p")
    s = p.read("x", sources.Collection([1]))
    with pytest.raises(PipelineError, match="stage 'x' is declared twice; give each stage"):
        s.map("x", str)


def test_unknown_input_says_which_stage_reads_it():
    g = Graph("p", (_src(), _map("a", "nope"), _sink("o", "a")))
    with pytest.raises(UnknownInputError, match="stage 'a' reads 'nope'"):
        validate(g)


def test_cycles_are_reported_with_their_path():
    g = Graph("p", (_src(), _map("a", "src", "b"), _map("b", "a"), _sink("o", "b")))
    with pytest.raises(CycleError, match="a -> b -> a|b -> a -> b"):
        validate(g)


def test_combine_on_unkeyed_stream_says_to_key_it():
    g = Graph(
        "p",
        (_src(), Exchange("x", ("src",)), Combine("c", ("x",), combine_fn=Sum()), _sink("o", "c")),
    )
    with pytest.raises(NotKeyedError, match=r"add \.key_by\(\.\.\.\) before 'x'"):
        validate(g)


def test_api_refuses_combine_on_unkeyed_stream():
    p = Pipeline("p")
    with pytest.raises(PipelineError, match="needs a keyed stream"):
        p.read("s", sources.Collection([1])).combine_per_key("c", "sum")


def test_full_combine_must_follow_an_exchange():
    g = Graph(
        "p",
        (
            _src(),
            FlatMap("k", ("src",), fn=lambda x: ((x, x),), keyed=True),
            Combine("c", ("k",), combine_fn=Sum(), phase=Phase.FULL),
            _sink("o", "c"),
        ),
    )
    with pytest.raises(GraphError, match="must read an exchange"):
        validate(g)


def test_pipeline_without_sink_is_refused():
    p = Pipeline("p")
    p.read("s", sources.Collection([1])).map("m", str)
    with pytest.raises(NoSinkError, match="writes nothing: add a sink"):
        p.graph  # noqa: B018


def test_sink_cannot_be_read():
    g = Graph("p", (_src(), _sink("o", "src"), _map("a", "o"), _sink("o2", "a")))
    with pytest.raises(GraphError, match="sink 'o' is read by 'a'"):
        validate(g)


def test_merge_of_keyed_and_unkeyed_is_refused():
    p = Pipeline("p")
    s = p.read("s", sources.Collection([1]))
    with pytest.raises(PipelineError, match="mixes keyed and unkeyed"):
        p.merge("m", s, s.key_by("k", str))


@pytest.mark.parametrize("name", ["", "a/b", "x\ny", None])
def test_bad_stage_names_are_refused(name):
    p = Pipeline("p")
    with pytest.raises(PipelineError):
        p.read(name, sources.Collection([1]))


@pytest.mark.parametrize("name", ["", "has space", "-lead", "x" * 101, "a/b"])
def test_bad_pipeline_names_are_refused(name):
    with pytest.raises(PipelineError, match="not valid"):
        Pipeline(name)


def test_keyedness_is_tracked():
    p = Pipeline("p")
    s = p.read("s", sources.Collection([1]))
    k = s.key_by("k", str)
    f = k.filter("f", bool)
    m = f.map("m", str)
    c = k.combine_per_key("c", "count")
    c.write("o", sinks.Collect())
    m.write("o2", sinks.Collect())
    keyed = p.graph.keyed
    assert (keyed["s"], keyed["k"], keyed["f"], keyed["m"], keyed["c"]) == (
        False,
        True,
        True,
        False,
        True,
    )


def _keyed(p):
    return p.read("s", sources.Collection([("a", 1)])).key_by("k", lambda kv: kv[0])


def _unread(s):
    s.window("w", 60)  # the windowed stream is dropped: s itself is written
    s.write("out", sinks.Collect())


def _branch_without(w):
    w.count_per_key("c").write("out", sinks.Collect())
    w.write("raw", sinks.Collect())


@pytest.mark.parametrize(
    ("build", "problem"),
    [
        (lambda s: s.window("w", 60).write("out", sinks.Collect()), "sink 'out'"),
        (
            lambda s: s.window("w", 60).map_values("v", str).write("out", sinks.Collect()),
            "sink 'out'",
        ),
        (_unread, "nothing reads 'w'"),
        (lambda s: _branch_without(s.window("w", 60)), "sink 'raw'"),
    ],
    ids=["written", "mapped-then-written", "read-by-nothing", "one-branch-without"],
)
def test_a_window_without_a_combine_after_it_is_refused(build, problem):
    p = Pipeline("p")
    build(_keyed(p))
    with pytest.raises(PipelineError, match=f"window 'w' only acts in a combine .*{problem}.*"):
        p.plan()


def test_a_window_reaches_its_combine_through_element_wise_steps():
    p = Pipeline("p")
    keyed = _keyed(p).window("w", 60).map_values("v", lambda kv: kv[1]).filter("f", bool)
    keyed.count_per_key("c").write("out", sinks.Collect())
    p.plan()
    assert p.graph["c"].windowing.fn.size_ms == 60_000

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.local_files import read_range


@settings(max_examples=60, deadline=None)
@given(
    lines=st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"")), max_size=30),
    split=st.integers(1, 40),
    crlf=st.booleans(),
)
def test_byte_ranges_cover_every_line_exactly_once(tmp_path_factory, lines, split, crlf):
    sep = b"\r\n" if crlf else b"\n"
    path = tmp_path_factory.mktemp("split") / "f.txt"
    data = sep.join(lines) + (sep if lines else b"")
    path.write_bytes(data)
    got = []
    for start in range(0, max(1, len(data)), split):
        got.extend(read_range(str(path), start, min(len(data), start + split)))
    assert [line for _, line in got] == [x.rstrip(b"\r") for x in lines]
    offsets = [o for o, _ in got]
    assert offsets == sorted(set(offsets))


def test_missing_input_names_the_path(tmp_path):
    from onceflow.connectors.files import TextFile

    src = TextFile(str(tmp_path / "nope*.txt"))
    with pytest.raises(ConnectorError, match="no input files match"):
        src.prepare("p", False)


def test_json_lines_sink_writes_one_file_in_a_bounded_run(tmp_path, spark):
    from onceflow.pipeline import Pipeline, sinks, sources

    out = tmp_path / "out.jsonl"
    p = Pipeline("jsonl")
    p.read("s", sources.Collection([{"a": 1}, {"a": 2}, {"a": (3, b"x")}])).write(
        "w", sinks.JsonLines(str(out))
    )
    p.run(session=spark, progress=False, output_dir=str(tmp_path))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(rows, key=str) == sorted(
        [{"a": 1}, {"a": 2}, {"a": [3, {"$base64": "eA=="}]}], key=str
    )
    assert not (tmp_path / "out.jsonl.parts").exists()

"""CSV files of a watched folder as records, read the way the source stage's task reads them
(the listing Spark hands it, without Spark): quoted fields, records over several lines, bad
records as dead letters and the next ones read."""

from __future__ import annotations

import pytest

from onceflow import sources
from onceflow.connectors.errors import ConnectorError
from onceflow.kernel import ids
from onceflow.kernel.records import DeadLetter, Record
from tests.connectors.test_file_stream import _listed


def _read(tmp_path, body: bytes, **options):
    path = tmp_path / "a.csv"
    path.write_bytes(body)
    source = sources.Csv(str(tmp_path), watch=True, **options)
    out = list(source.decoder("landing", True)(_listed((str(path), len(body)))))
    records = [r for r in out if isinstance(r, Record)]
    letters = [r for r in out if isinstance(r, DeadLetter)]
    return path, records, letters


def test_a_header_names_the_fields_and_quoted_fields_hold_commas_quotes_and_newlines(tmp_path):
    body = b'id,name,note\r\n1,Ann,"a, b"\r\n2,"Bo ""B""","two\nlines"\r\n\r\n3,Cy,\r\n'
    path, records, letters = _read(tmp_path, body)
    assert not letters
    assert [r.elem for r in records] == [
        {"id": "1", "name": "Ann", "note": "a, b"},
        {"id": "2", "name": 'Bo "B"', "note": "two\nlines"},
        {"id": "3", "name": "Cy", "note": ""},
    ]
    offsets = [body.index(b"1,Ann"), body.index(b"2,"), body.index(b"3,Cy")]
    assert [r.offset for r in records] == offsets
    assert records[1].id == ids.from_position("landing", str(path), 0, offsets[1])


def test_bad_records_are_dead_letters_saying_why_and_the_next_are_read(tmp_path):
    body = b'id,name\n1,a\n2,b,extra\n\xff\xfe,x\n4\n5,e\n6,"open\n'
    path, records, letters = _read(tmp_path, body)
    assert [r.elem["id"] for r in records] == ["1", "5"]
    reasons = {letter.origin: letter.error for letter in letters}
    assert all(letter.code == "undecodable" for letter in letters)

    def at(part: bytes) -> str:
        return reasons[f"{path}@{body.index(part)}"]

    assert "3 fields, the header names 2" in at(b"2,b")
    assert "not UTF-8" in at(b"\xff")
    assert "1 fields, the header names 2" in at(b"4\n")
    assert at(b"6,"), "a quote left open at the end: a letter"


def test_columns_name_headerless_files_and_without_either_a_record_is_a_list(tmp_path):
    _, records, _ = _read(tmp_path, b"1;a\n2;b\n", columns=["id", "name"], delimiter=";")
    assert [r.elem for r in records] == [{"id": "1", "name": "a"}, {"id": "2", "name": "b"}]
    _, records, _ = _read(tmp_path, b"1,a\n2,b\n", header=False)
    assert [r.elem for r in records] == [["1", "a"], ["2", "b"]]


def test_an_id_function_and_a_timestamp_function_read_the_row(tmp_path):
    body = b"event,ts\ne1,1700000000000\ne2,1700000000500\n"
    _, records, _ = _read(tmp_path, body, id=lambda r: r["event"], timestamp=lambda r: int(r["ts"]))
    assert [r.id for r in records] == [ids.from_user_key("e1"), ids.from_user_key("e2")]
    assert [r.ts for r in records] == [1700000000000, 1700000000500]


def test_a_csv_folder_is_watched():
    with pytest.raises(ConnectorError, match="read as a stream"):
        sources.Csv("/tmp/x")
    assert "csv" in sources.Csv("/tmp/x", watch=True).describe()

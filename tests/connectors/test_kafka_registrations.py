"""The notes a transactional id's registration leaves for the other processes of a machine."""

from __future__ import annotations

import multiprocessing
import os

from onceflow.connectors.kafka import registrations
from onceflow.connectors.kafka.registrations import note_registered, registered_elsewhere


def _register_in_child(bootstrap: str, tid: str) -> None:
    note_registered(bootstrap, tid)


def test_a_registration_in_another_process_is_seen_and_ones_own_is_not():
    tid = f"onceflow.p{os.getpid()}.out.0"
    mine = note_registered("k:9092", tid)
    assert mine is not None
    assert not registered_elsewhere("k:9092", tid, mine)
    child = multiprocessing.get_context("fork").Process(
        target=_register_in_child, args=("k:9092", tid)
    )
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert registered_elsewhere("k:9092", tid, mine)
    assert not registered_elsewhere("other:9092", tid, note_registered("other:9092", tid)), (
        "each Kafka cluster's ids are apart"
    )


def test_without_a_note_nothing_is_assumed():
    assert not registered_elsewhere("k:9092", "never.registered.0", "some-token")
    assert not registered_elsewhere("k:9092", "never.registered.0", None)


def test_a_folder_others_can_enter_keeps_no_notes(tmp_path, monkeypatch):
    open_to_all = tmp_path / f"onceflow-txn-{os.getuid()}"
    open_to_all.mkdir(mode=0o777)
    open_to_all.chmod(0o777)
    monkeypatch.setattr(registrations.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(registrations, "_FOLDER", [])
    assert note_registered("k:9092", "t.out.0") is None
    assert list(open_to_all.iterdir()) == []

"""The session's settings that are Onceflow's own choice: sockets to the Python workers."""

from __future__ import annotations

import os
import socket
import stat

import pytest

from onceflow.runtime import session
from onceflow.runtime.session import (
    UDS_CONF,
    UDS_DIR_CONF,
    local_socket_conf,
    private_socket_dir,
    sweep_sockets,
)


def test_local_masters_talk_to_workers_over_unix_sockets_in_a_private_folder():
    conf = local_socket_conf("local[2]")
    assert conf[UDS_CONF] == "true"
    mode = os.stat(conf[UDS_DIR_CONF]).st_mode
    assert stat.S_IMODE(mode) == 0o700, "Spark's Unix sockets carry no secret"
    assert len(conf[UDS_DIR_CONF]) + 42 < 108, "room for Spark's socket names"
    assert local_socket_conf("spark://host:7077") == {}, "the folder may not exist on workers"


def test_a_shared_folder_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setattr(session.tempfile, "gettempdir", lambda: str(tmp_path))
    open_to_all = tmp_path / f"onceflow-sockets-{os.getuid()}"
    open_to_all.mkdir(mode=0o777)
    open_to_all.chmod(0o777)
    chosen = private_socket_dir()
    assert chosen != str(open_to_all)
    assert stat.S_IMODE(os.stat(chosen).st_mode) == 0o700


def test_sockets_of_killed_runs_are_swept_and_live_ones_kept(tmp_path):
    if not os.path.exists("/proc/net/unix"):
        pytest.skip("needs Linux's /proc/net/unix")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(tmp_path / ".live.sock"))
    live.listen(1)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(tmp_path / ".dead.sock"))
    dead.close()  # the file stays, as after a kill -9
    (tmp_path / "notes.txt").write_text("not a socket of ours")
    try:
        assert sweep_sockets(str(tmp_path)) == 1
        assert sorted(os.listdir(tmp_path)) == [".live.sock", "notes.txt"]
    finally:
        live.close()

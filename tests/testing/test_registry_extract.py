"""Unpacking the registry's archive: the same safety with and without ``filter="data"``.

Debian 12's own Python (3.11.2) has no ``tarfile.data_filter`` (3.11.4+); the fallback checks
every member itself. Each case runs on both paths.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from onceflow.kernel.errors import ServiceError
from onceflow.testing import registry


def _archive(path: Path, members: list[tuple[str, str, str]]) -> Path:
    """A .tar.gz of (name, kind, payload): kind file/dir/sym/hard/fifo."""
    with tarfile.open(path, "w:gz") as tar:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            data = None
            if kind == "file":
                data = payload.encode()
                info.size = len(data)
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
            elif kind == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, payload
            elif kind == "hard":
                info.type, info.linkname = tarfile.LNKTYPE, payload
            else:
                info.type = tarfile.FIFOTYPE
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


@pytest.fixture(params=["filter", "own-check"])
def extraction(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a case with Python's data filter, and again as on 3.11.2 (no filter)."""
    if request.param == "own-check":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    elif not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python has no tarfile.data_filter (< 3.11.4)")
    return str(request.param)


def test_a_plain_archive_unpacks(tmp_path: Path, extraction: str) -> None:
    members = [
        ("app", "dir", ""),
        ("app/lib", "dir", ""),
        ("app/run.jar", "file", "jar"),
        ("app/lib/a.jar", "file", "a"),
        ("app/current", "sym", "run.jar"),
        ("app/copy.jar", "hard", "app/run.jar"),
    ]
    archive = _archive(tmp_path / "ok.tar.gz", members)
    registry.extract_tar(archive, tmp_path / "out")
    assert (tmp_path / "out/app/run.jar").read_text() == "jar"
    assert (tmp_path / "out/app/lib/a.jar").read_text() == "a"
    assert (tmp_path / "out/app/current").read_text() == "jar"
    assert (tmp_path / "out/app/copy.jar").read_text() == "jar"


@pytest.mark.parametrize(
    "member",
    [
        ("../escape.txt", "file", "x"),
        ("/tmp/onceflow-absolute-escape.txt", "file", "x"),
        ("app/link", "sym", "../../etc/passwd"),
        ("app/abslink", "sym", "/etc/passwd"),
        ("app/hard", "hard", "../outside"),
    ],
    ids=["dotdot", "absolute", "symlink-out", "symlink-absolute", "hardlink-out"],
)
def test_a_member_that_escapes_is_refused(
    tmp_path: Path, extraction: str, member: tuple[str, str, str]
) -> None:
    archive = _archive(tmp_path / "bad.tar.gz", [("app", "dir", ""), member])
    refused = (ServiceError, getattr(tarfile, "FilterError", ServiceError))
    with pytest.raises(refused):
        registry.extract_tar(archive, tmp_path / "out")
    assert not (tmp_path / "escape.txt").exists()


def test_the_own_check_refuses_devices_and_names_the_members(tmp_path: Path) -> None:
    archive = _archive(tmp_path / "fifo.tar.gz", [("app", "dir", ""), ("app/pipe", "fifo", "")])
    with tarfile.open(archive) as tar:
        assert registry.unsafe_members(tar.getmembers(), tmp_path / "out") == ["app/pipe"]

"""The built wheel installs one import package, ``onceflow``, and runs next to users' modules.

The wheel is built from the repository, installed (not editable) into a fresh virtual env
whose dependencies come from this env's site-packages through a path file (so nothing is
downloaded and this env's editable install of Onceflow stays invisible to it), and a pipeline
file is run with ``python -m onceflow run`` from a folder that also holds the user's own
``pipeline.py``, ``backup.py`` and ``dedup.py``, which the pipeline uses on the workers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The test session puts the repository on PYTHONPATH (for Spark's workers); the fresh env must
# not see it, or the repository's folders and its egg-info would pass for an installed package.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYSPARK_PYTHON")}

USER_FILES = {
    "pipeline.py": "NAME = 'the user pipeline module'\n\ndef shout(s):\n    return s.upper()\n",
    "backup.py": "def double(x):\n    return 2 * x\n",
    "dedup.py": "def keep(x):\n    return x % 3 != 0\n",
    "job.py": textwrap.dedent(
        """
        import os

        import backup
        import dedup
        import pipeline as mine
        from onceflow import Pipeline, sinks, sources

        p = Pipeline("wheel-check")
        (
            p.read("nums", sources.Collection(list(range(30))))
            .filter("keep", dedup.keep)
            .map("double", backup.double)
            .map("label", lambda x: {"n": x, "by": mine.shout("ok")})
            .write("out", sinks.JsonLines(os.environ["WHEEL_OUT"]))
        )
        """
    ),
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (found,) = out.glob("onceflow-*.whl")
    return found


def test_the_wheel_holds_one_top_level_package(wheel):
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist()}
        top_level = zf.read(next(n for n in zf.namelist() if n.endswith("top_level.txt")))
    assert {t for t in tops if not t.endswith(".dist-info")} == {"onceflow"}
    assert top_level.decode().split() == ["onceflow"]
    assert any(
        n.startswith("onceflow/runtime/spark_env/log4j2.properties")
        for n in tops | set(zf.namelist())
    )
    page = {f"onceflow/operations/ui.{ext}" for ext in ("html", "css", "js")}
    assert page <= set(zf.namelist()), "the live page's files are not in the wheel"
    lua = {n for n in zf.namelist() if n.startswith("onceflow/kernel/lua/")}
    assert "onceflow/kernel/lua/commit.lua" in lua and len(lua) > 20, "the Redis scripts"


@pytest.fixture(scope="module")
def fresh_env(wheel, tmp_path_factory) -> Path:
    env = tmp_path_factory.mktemp("fresh") / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
            env=CLEAN_ENV,
        ).strip()
    )
    before = set(os.listdir(site))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "-q",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
        env=CLEAN_ENV,
        cwd=env.parent,  # not the repository: its egg-info would pass for an installed one
    )
    new = set(os.listdir(site)) - before
    packages = {n for n in new if not n.endswith(".dist-info") and n != "__pycache__"}
    assert packages == {"onceflow"}, f"the wheel installed top-level names {sorted(packages)}"
    # Dependencies from this env, as a plain path entry (written after the install, so pip
    # does not take this env's Onceflow for an installed one): .pth files in that folder are
    # not processed, so this env's editable Onceflow stays invisible to the fresh one.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env


def test_a_pipeline_next_to_users_own_pipeline_backup_and_dedup_modules_runs(fresh_env, tmp_path):
    for name, text in USER_FILES.items():
        (tmp_path / name).write_text(text)
    out = tmp_path / "out.jsonl"
    python = fresh_env / "bin" / "python"
    env = {**CLEAN_ENV, "WHEEL_OUT": str(out)}
    proc = subprocess.run(
        [
            str(python),
            "-m",
            "onceflow",
            "run",
            "job.py",
            "--no-progress",
            "--output-dir",
            str(tmp_path / "o"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    where = subprocess.check_output(
        [str(python), "-c", "import onceflow; print(onceflow.__file__)"],
        cwd=tmp_path,
        text=True,
        env=CLEAN_ENV,
    )
    assert str(fresh_env) in where, f"onceflow came from {where}, not the installed wheel"
    rows = sorted(json.loads(line)["n"] for line in out.read_text().splitlines())
    assert rows == sorted(2 * x for x in range(30) if x % 3 != 0)
    assert all(json.loads(line)["by"] == "OK" for line in out.read_text().splitlines())
    page = subprocess.check_output(
        [
            str(python),
            "-c",
            "from onceflow.operations.ui import page_html as p; print(p('n', '', ''))",
        ],
        cwd=tmp_path,
        text=True,
        env=CLEAN_ENV,
    )
    assert "--accent:" in page and "async function poll()" in page  # its style and script

"""Type-check the ``onceflow`` package as it is installed, straight from the source folders.

The repository's folders install as subpackages of ``onceflow`` through setuptools'
package-dir mapping, and an editable install serves them through an import hook that mypy
does not follow: pointed at the folders, mypy would see top-level ``pipeline``, ``dedup``
... packages and never resolve ``onceflow.pipeline``. So this builds the installed layout
as a tree of symbolic links (``build/typecheck/onceflow/<subpackage> -> <folder>``), read
from ``pyproject.toml``'s mapping, and runs ``mypy -p onceflow`` on it with the settings
in ``pyproject.toml``. It prints mypy's report with paths mapped back to the folders and
exits with mypy's status. It also checks that mypy saw every module of every folder.

    python tools/typecheck.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"


def package_dirs() -> dict[str, str]:
    """Pyproject's ``[tool.setuptools.package-dir]``: package -> folder."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(config["tool"]["setuptools"]["package-dir"])


def build_tree(tree: Path = TREE) -> dict[Path, Path]:
    """The installed layout as symbolic links under ``tree``; returns link -> folder.

    The documentation build (``tools/mkdocs_hooks.py``) lays out its own tree the same way.
    """
    shutil.rmtree(tree, ignore_errors=True)
    top = tree / "onceflow"
    top.mkdir(parents=True)
    links: dict[Path, Path] = {}
    for package, folder in sorted(package_dirs().items()):
        source = ROOT / folder
        if package == "onceflow":
            for entry in source.iterdir():
                if entry.suffix in (".py", ".typed"):
                    (top / entry.name).symlink_to(entry)
                    links[top / entry.name] = entry
            continue
        link = tree / package.replace(".", "/")
        link.symlink_to(source, target_is_directory=True)
        links[link] = source
    return links


def expected_modules() -> int:
    """How many ``.py`` files the mapped folders hold (what mypy must see)."""
    count = 0
    for package, folder in package_dirs().items():
        base = ROOT / folder
        files = base.glob("*.py") if package == "onceflow" else base.rglob("*.py")
        count += sum(1 for f in files if "__pycache__" not in f.parts)
    return count


def main() -> int:
    """Build the tree, run mypy, map paths back, check the module count."""
    links = build_tree()
    env = {**os.environ, "MYPYPATH": str(TREE)}
    cmd = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "-p",
        "onceflow",
    ]
    proc = subprocess.run(cmd, cwd=TREE, env=env, capture_output=True, text=True, check=False)
    out = proc.stdout + proc.stderr
    for link, source in sorted(links.items(), key=lambda x: -len(str(x[0]))):
        out = out.replace(str(link.relative_to(TREE)), str(source.relative_to(ROOT)))
    print(out, end="")
    match = re.search(r"in (\d+) source files?", out)
    checked = int(match.group(1)) if match else 0
    want = expected_modules()
    if proc.returncode == 0 and checked != want:
        print(f"mypy checked {checked} modules but the package has {want}", file=sys.stderr)
        return 1
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())

"""The documentation site builds with ``mkdocs build --strict``, and its code is sound.

Strict mode turns every warning into a failure: a page missing from the navigation, a broken
link or anchor, a snippet whose file is gone, an API object mkdocstrings cannot find.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(out),
        ],
        cwd=tmp_path_factory.mktemp("elsewhere"),  # the build must not depend on where it starts
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    return out


def pages():
    return sorted(p.relative_to(DOCS) for p in DOCS.rglob("*.md"))


@pytest.mark.parametrize("page", pages(), ids=str)
def test_every_page_is_built(site, page):
    folder = page.parent if page.name == "index.md" else page.with_suffix("")
    assert (site / folder / "index.html").is_file(), f"{page} was not built"


def test_the_api_reference_is_generated_from_docstrings(site):
    html = (site / "reference" / "testing" / "index.html").read_text()
    assert "Run <code>pipeline</code> on <code>inputs</code>" in html  # run_test's docstring
    html = (site / "reference" / "pipeline" / "index.html").read_text()
    assert "combine_per_key" in html and "Fold the values of each key" in html


def test_no_rest_roles_leak_into_the_pages(site):
    leaks = [
        str(p.relative_to(site))
        for p in site.rglob("*.html")
        if re.search(r":(class|func|meth|mod|attr):", p.read_text())
    ]
    assert not leaks


@pytest.mark.parametrize("page", pages(), ids=str)
def test_python_examples_in_the_docs_compile(page):
    text = (DOCS / page).read_text()
    for block in FENCE.findall(text):
        if block.lstrip().startswith("--8<--"):
            continue  # included from a tested file
        ast.parse(block, filename=str(page))


def test_snippets_are_included_not_shown(site):
    # A snippet marker a formatter mangled (``--8 < --``) is not an include: the page would
    # show the marker instead of the tested code.
    marker = re.compile(r"--8\s*&lt;")
    shown = [str(p.relative_to(site)) for p in site.rglob("*.html") if marker.search(p.read_text())]
    assert not shown
    html = (site / "testing" / "index.html").read_text()
    assert "clicks_stream" in html  # a function of tests/docs/test_tutorial.py, included


def test_the_readme_points_to_the_docs():
    assert "docs/" in (ROOT / "README.md").read_text()

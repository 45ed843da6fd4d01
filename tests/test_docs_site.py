"""The documentation site (mkdocs.yml) is strict: a broken link or a page left out of the navigation fails.

`make test` builds the real site (`make docs`); these tests show the build would fail on either mistake, on a copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).parent / "mkdocs"
pytestmark = pytest.mark.skipif(not MKDOCS.exists(), reason="mkdocs is not installed (the `docs` extra)")


def build(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(root / "site")], cwd=root,
                          capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
                          timeout=300)  # fmt: skip


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    os.symlink(REPO / "core", tmp_path / "core")  # the API reference reads the docstrings there
    return tmp_path


def test_the_site_builds(copy):
    res = build(copy)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (copy / "site" / "api" / "index.html").read_text().count("doc-heading") > 100  # the API, documented


def test_a_broken_link_fails_the_build(copy):
    page = copy / "docs" / "routing.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    res = build(copy)
    assert res.returncode != 0 and "no-such-page.md" in res.stderr


def test_a_page_left_out_of_the_navigation_fails_the_build(copy):
    (copy / "docs" / "orphan.md").write_text("# Orphan\n")
    res = build(copy)
    assert res.returncode != 0 and "orphan.md" in res.stderr

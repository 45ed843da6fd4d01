"""One release: every distribution at the kernel's version, plugins pinned to its minor release, Pythons as tested.

`make dist` builds them (docs/install.md); `make test-dist` installs the wheels in clean venvs and runs
tests/wheel_smoke.py. This test keeps the metadata those rely on consistent.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import nexuskv

REPO = Path(__file__).resolve().parents[1]
PROJECTS = [REPO / "pyproject.toml", *sorted(REPO.glob("plugins/*/pyproject.toml"))]
ENGINE_PLUGINS = {"nexuskv-vllm", "nexuskv-sglang", "nexuskv-transformers"}  # tested on their engines' Python only


def _project(path: Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


KERNEL = _project(REPO / "pyproject.toml")
VERSION = Version(KERNEL["version"])


def _makefile_pythons() -> list[str]:
    m = re.search(r"^PYTHONS\s*:=\s*(.+)$", (REPO / "Makefile").read_text(), re.M)
    assert m, "the Makefile names the supported Pythons (PYTHONS := ...)"
    return m.group(1).split()


@pytest.mark.parametrize("path", PROJECTS, ids=lambda p: p.parent.name)
def test_every_distribution_is_at_the_kernels_version(path):
    assert Version(_project(path)["version"]) == VERSION


def test_the_package_and_the_command_say_the_same_version():
    assert nexuskv.__version__ == str(VERSION)
    out = subprocess.run([str(Path(sys.executable).parent / "nexuskv"), "--version"], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert out.strip() == f"nexuskv {VERSION}"


@pytest.mark.parametrize("path", PROJECTS[1:], ids=lambda p: p.parent.name)
def test_a_plugin_requires_the_kernels_minor_release(path):
    """`nexuskv>=X.Y.Z,<X.(Y+1)`: a 0.x minor release may change the hooks, so a plugin never floats past it."""
    ours = [Requirement(r) for r in _project(path)["dependencies"] if Requirement(r).name.startswith("nexuskv")]
    assert "nexuskv" in {r.name for r in ours}
    for req in ours:
        assert req.name == "nexuskv" or (REPO / "plugins" / req.name / "pyproject.toml").exists(), req
        assert req.specifier.contains(str(VERSION)), req
        assert not req.specifier.contains(f"{VERSION.major}.{VERSION.minor + 1}.0"), f"{req} floats past {VERSION}"
        assert not req.specifier.contains(f"{VERSION.major}.{VERSION.minor}.{VERSION.micro}rc0"), req


@pytest.mark.parametrize("path", PROJECTS, ids=lambda p: p.parent.name)
def test_classifiers_name_the_pythons_make_test_runs(path):
    project = _project(path)
    said = sorted(c.rsplit(" :: ", 1)[1] for c in project["classifiers"]
                  if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))  # fmt: skip
    expected = ["3.11"] if project["name"] in ENGINE_PLUGINS else _makefile_pythons()
    assert said == expected
    assert project["requires-python"] == f">={expected[0]}"


def test_the_wheel_carries_the_files_the_kernel_reads_beside_its_code():
    """`nexuskv demo` reads policies/, `schema export --check` schemas/: the wheel ships both (resources.shipped)."""
    from nexuskv.resources import SHIPPED, shipped

    wheel = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert wheel["force-include"] == {name: f"nexuskv/_shipped/{name}" for name in SHIPPED}
    sdist = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["sdist"]
    assert {f"/{name}" for name in SHIPPED} <= set(sdist["include"])
    for name in SHIPPED:
        assert shipped(name) == REPO / name  # in a checkout, the repository's own
    with pytest.raises(ValueError, match="not shipped"):
        shipped("profiles")


@pytest.mark.parametrize("path", PROJECTS, ids=lambda p: p.parent.name)
def test_every_distribution_ships_the_license_it_declares(path):
    """Apache-2.0 asks that users get a copy of the license: each distribution's folder holds it (its wheel's
    `licenses/` and its sdist take it from there)."""
    assert _project(path)["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert (path.parent / "LICENSE").read_text() == text

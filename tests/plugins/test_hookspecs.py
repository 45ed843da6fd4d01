"""Every hook must be documented in docs/plugins.md with its exact signature."""

from pathlib import Path

import pytest

import nexuskv.plugins.hookspecs as hookspecs

DOC = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
HOOKS = sorted(n for n in dir(hookspecs) if n.startswith("nexuskv_"))


def signature(name: str) -> str:
    ann = dict(getattr(hookspecs, name).__annotations__)
    ret = ann.pop("return")
    return f"{name}(" + ", ".join(f"{p}: {t}" for p, t in ann.items()) + f") -> {ret}"


def test_there_are_hooks():
    assert len(HOOKS) >= 8


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_with_its_signature(hook):
    assert f"### `{hook}`" in DOC, f"docs/plugins.md has no section for {hook}"
    assert signature(hook) in DOC, f"docs/plugins.md does not show {signature(hook)}"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_docstring(hook):
    assert (getattr(hookspecs, hook).__doc__ or "").strip()


def test_docs_name_no_hook_that_does_not_exist():
    import re

    documented = set(re.findall(r"### `(nexuskv_\w+)`", DOC))
    assert documented == set(HOOKS)

"""docs/cel.md is the CEL engine's page: every example on it runs, and every public name is on it."""

import re
from pathlib import Path

import pytest

import nexuskv.cel
import nexuskv.cel.conformance

DOC = (Path(__file__).resolve().parents[2] / "docs" / "cel.md").read_text()
EXAMPLES = re.findall(r"```python\n(.*?)```", DOC, re.S)


def test_the_page_has_examples():
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("n", range(len(EXAMPLES)))
def test_every_example_runs(n, capsys):
    exec(compile(EXAMPLES[n], f"docs/cel.md example {n + 1}", "exec"), {})


@pytest.mark.parametrize("module", [nexuskv.cel, nexuskv.cel.conformance], ids=lambda m: m.__name__)
def test_every_public_name_is_on_the_page(module):
    missing = [name for name in module.__all__ if not re.search(rf"`{re.escape(name)}\b", DOC)]
    assert missing == []

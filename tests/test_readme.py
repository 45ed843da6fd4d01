"""The README's embedding example must run and print what it says it prints."""

import contextlib
import io
import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_readme_leads_with_the_two_commands():
    head = README[: README.index("## Embedding")]
    assert "make demo" in head and "make test" in head


def test_embedding_example_runs(monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    assert out.getvalue().split() == ["recompute", "materialize", "992"]
    assert len(code.strip().splitlines()) <= 25

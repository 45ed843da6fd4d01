"""Every bench runs, and prints every RESULT it promises: each one, in quick mode, as a subprocess.

What a bench promises and what quick mode is are in bench/_common.py's docstring. The benches are found by glob
(a new one is covered without a line here): every `bench/*.py` not starting with `_`, and a helper that also runs
on its own as a study or a dump (it declares `RESULTS` too). Each declares `RESULTS`, the names of the RESULT lines
it prints in full mode; run with `NEXUSKV_BENCH_QUICK=1` it must exit 0 and print exactly those names, each line
as the checker reads it (`RESULT name value op goal`). Goals are not checked: the values of a quick run mean
nothing. A bench that cannot run here (a binary or its engine's venv missing) prints `SKIP why`, and its test is
skipped with that reason; a bench that runs in another venv names it (`VENV`) and runs with that venv's python.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
RESULT_LINE = re.compile(r"RESULT (\S+) (-?(?:[0-9.]+(?:e[+-]?[0-9]+)?|nan|inf)) (<=|>=|<|>|==) (-?[0-9.e+]+|inf)")
TIMEOUT_S = 600  # the slowest (bench/cluster.py: three node processes, etcd, Redis, faults) takes 1-2 minutes


def declared(path: Path) -> dict[str, object]:
    """The module-level `RESULTS` and `VENV` of a bench, read from its source (never imported)."""
    out: dict[str, object] = {}
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id in ("RESULTS", "VENV")):  # fmt: skip
            out[node.targets[0].id] = ast.literal_eval(node.value)
    return out


def written_names(path: Path) -> set[str]:
    """RESULT names written literally in a bench: `result("name", ...)` and strings starting `RESULT name `."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "result" and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):  # fmt: skip
            names.add(node.args[0].value)
        text = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else node
        if isinstance(text, ast.Constant) and isinstance(text.value, str):
            names.update(re.findall(r"^RESULT ([\w.]+) ", text.value))
    return names


def benches() -> list[Path]:
    """Every bench: the files of bench/ not starting with `_`, and the helpers that run on their own."""
    return sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_") or "RESULTS" in declared(p))


BENCHES = benches()
IDS = [p.stem for p in BENCHES]


def test_the_benches_are_found():
    assert {"identity", "plan_latency", "tiers", "cluster", "vllm_ttft", "_eviction_study"} <= set(IDS)
    assert "_common" not in IDS and "_tier_redis" not in IDS  # helpers that only other benches run


@pytest.mark.parametrize("bench", BENCHES, ids=IDS)
def test_every_bench_declares_the_results_it_prints(bench):
    got = declared(bench)
    assert "RESULTS" in got, f"{bench.name}: declare RESULTS = (...), the RESULT names it prints (bench/_common.py)"
    results = got["RESULTS"]
    assert isinstance(results, tuple) and all(isinstance(n, str) and re.fullmatch(r"[\w.]+", n) for n in results)
    assert len(set(results)) == len(results), "a name twice"
    assert written_names(bench) - set(results) == set(), f"{bench.name} prints RESULTs its RESULTS does not name"


def test_the_names_a_bench_writes_are_read_from_its_source(tmp_path):
    f = tmp_path / "b.py"
    f.write_text('result("a.x", 1, "<=", 2)\nprint(f"RESULT b.y {v:.2f} >= 3")\nprint(f"RESULT c.{m}_z {v} <= 1")\n'
                 'RESULTS = ("a.x", "b.y")\nVENV = ".venv-x"\n')  # fmt: skip
    assert written_names(f) == {"a.x", "b.y"}  # a name made at run time is left to the run
    assert declared(f) == {"RESULTS": ("a.x", "b.y"), "VENV": ".venv-x"}


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("bench", BENCHES, ids=IDS)
def test_every_bench_runs_in_quick_mode_and_prints_every_result_it_promises(bench):
    got = declared(bench)
    python = sys.executable
    if "VENV" in got:
        python = str(REPO / str(got["VENV"]) / "bin" / "python")
        if not Path(python).exists():
            setup = str(got["VENV"]).removeprefix(".venv-") + "-setup"
            pytest.skip(f"{bench.name} runs in {got['VENV']}, which is not built here (`make {setup}` builds it)")
    plots = {p: p.stat().st_mtime_ns for p in (REPO / "docs" / "img").glob("*")}
    t0 = time.monotonic()
    run = subprocess.run([python, str(bench)], cwd=REPO, env={**os.environ, "NEXUSKV_BENCH_QUICK": "1"},
                         capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
    took = time.monotonic() - t0
    tail = f"\n--- stdout (end) ---\n{run.stdout[-4000:]}\n--- stderr (end) ---\n{run.stderr[-4000:]}"
    skip = [ln[5:] for ln in run.stdout.splitlines() if ln.startswith("SKIP ")]
    if skip and run.returncode == 0:
        pytest.skip(f"{bench.name}: {skip[0]}")
    assert run.returncode == 0, f"{bench.name} exited {run.returncode} after {took:.0f} s{tail}"
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert [ln for ln in lines if not RESULT_LINE.fullmatch(ln)] == [], f"not `RESULT name value op goal`{tail}"
    printed = [ln.split()[1] for ln in lines]
    assert sorted(printed) == sorted(got["RESULTS"]), f"{bench.name} printed {printed}{tail}"
    assert {p: p.stat().st_mtime_ns for p in plots if p.exists()} == plots, "quick mode wrote into docs/img"

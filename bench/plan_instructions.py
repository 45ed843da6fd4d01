"""Instructions per plan, counted by valgrind (callgrind): a figure the machine's load does not move.

Run: `.venv/bin/python bench/plan_instructions.py [--against CHECKOUT]` (about ten minutes; needs valgrind).
A kernel with one DRAM tier, the shipped policies and the native keyer and index (the only entry-point plugin
loaded) holds a 4,096-token request of the `chat` tenant; one process plans it 20 times, another 220 times, each
under callgrind, and the difference over 200 is the instructions of one plan (start-up cancels out). "Warm" passes
the request's keys, "cold" computes them in `plan`. A plan that falls back (reuses less than the whole request)
fails the run: fallbacks are never counted in. With `--against`, the same runs are made on another checkout's
kernel (for example a `git worktree` of an older revision, its `core/` put first on `PYTHONPATH`, this venv's
plugins), and the ratios are the figures: a refactoring that claims no behaviour change should keep them near 1.
Wall-clock benches on this shared machine move by 1.5x between runs; instruction counts repeat to within about 1%.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK, quick

RESULTS = ("plan.instructions_warm_4k_over_against", "plan.instructions_cold_4k_over_against")  # with --against
ROOT = Path(__file__).resolve().parents[1]
RUNS = quick((20, 220), (1, 2))
# Quick mode runs the workload without valgrind (one callgrind run of it takes minutes on this machine), each
# plan counted as one instruction, and compares this checkout with itself: the workload, its checks and the
# report run, the counts mean nothing.

WORKLOAD = '''
import io, random, sys
from pathlib import Path
from nexuskv import Kernel, KernelConfig, Layout, ModelIdentity, Request, StateGroup, TokenizerIdentity
from nexuskv import configure_logging
configure_logging(json=True, stream=io.StringIO(), force=True)
policies, n, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
layout = Layout(groups=[StateGroup(kind="dense", layers=4, kv_heads=2, head_dim=64)], page_size=16)
rng = random.Random(3)
tokens = [rng.randrange(30000) for _ in range(4096)]
cfg = KernelConfig(node="n1", policies=policies, deadline_ms=100000.0,
                   tiers={"dram": {"store": "dram", "capacity_bytes": "512MiB"}})
with Kernel(cfg, secret=bytes(32)) as k:
    req = Request(request_id="r", tenant="chat", model=ModelIdentity(name="tiny-llama", revision="1"),
                  tokenizer=TokenizerIdentity(name="t"), layout=layout, token_ids=tokens)
    keys = k.keys(req)
    k.commit(req, [bytes(1024)] * len(keys), keys=keys)
    k.flush(30)
    fell = 0
    for _ in range(n):
        plan = k.plan(req, keys=keys) if mode == "warm" else k.plan(req)
        fell += plan.tokens_reused != 4096
    if fell:  # a plan that fell back did less work: it must fail the run, never be averaged in
        raise SystemExit(f"{fell} of {n} plans fell back: {plan.reasons}")
'''


def instructions(checkout: Path, n: int, mode: str, script: Path) -> int:
    """Instructions callgrind counts for one process making `n` plans on `checkout`'s kernel."""
    env = dict(os.environ, NEXUSKV_PLUGINS="native", PYTHONHASHSEED="0")
    if checkout != ROOT:
        env["PYTHONPATH"] = str(checkout / "core")
    if QUICK:
        out = subprocess.run([sys.executable, str(script), str(checkout / "policies"), str(n), mode], cwd=checkout,
                             env=env, capture_output=True, text=True)  # fmt: skip
        if out.returncode:
            raise SystemExit(f"the workload failed:\n{out.stderr[-2000:]}")
        return n
    out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
                          str(script), str(checkout / "policies"), str(n), mode],
                         cwd=checkout, env=env, capture_output=True, text=True, check=True)  # fmt: skip
    got = re.search(r"Collected : (\d+)", out.stderr)
    if got is None:
        raise SystemExit(f"no count from callgrind:\n{out.stderr[-2000:]}")
    return int(got.group(1))


def per_plan(checkout: Path, mode: str, script: Path) -> float:
    few, many = (instructions(checkout, n, mode, script) for n in RUNS)
    return (many - few) / (RUNS[1] - RUNS[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", type=Path, default=quick(None, ROOT),
                    help="another checkout (its core/ is put on PYTHONPATH)")  # fmt: skip
    args = ap.parse_args()
    if shutil.which("valgrind") is None and not QUICK:
        print("valgrind is not installed (Debian: apt-get install valgrind); nothing measured")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "workload.py"
        script.write_text(WORKLOAD)
        for mode in ("warm", "cold"):
            ours = per_plan(ROOT, mode, script)
            print(f"{mode} 4,096-token plan: {ours:,.0f} instructions (this checkout)")
            if args.against is not None:
                same = QUICK and args.against.resolve() == ROOT  # quick mode: this checkout's counts again
                theirs = ours if same else per_plan(args.against.resolve(), mode, script)
                print(f"{mode} 4,096-token plan: {theirs:,.0f} instructions ({args.against})")
                print(f"RESULT plan.instructions_{mode}_4k_over_against {ours / theirs:.4f} <= 1.05")
    return 0


if __name__ == "__main__":
    sys.exit(main())

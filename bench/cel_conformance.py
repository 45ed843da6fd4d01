"""CEL conformance: the official cel-spec "simple" suite run against NexusKV's CEL compiler.

Run `.venv/bin/python bench/cel_conformance.py [SUITE_DIR]` (default: tests/data/cel-spec, the suite vendored
unmodified from ../shared/conformance/cel-spec). Every case that needs no protobuf message type is applicable;
each is compiled, evaluated by the fast and the exact path (which must agree), and compared with CEL's strict
value identity. cel-python runs the same cases through `_celpy_conformance` for comparison. Prints counts per
file, the cases not applicable by reason, every non-passing case with why, and ends with `RESULT` lines
(always exits 0).
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

from nexuskv.cel.conformance import load_cases, protobuf_reason, run_case

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _celpy_conformance
from _common import quick

RESULTS = ("cel.conformance_pass_fraction", "cel.conformance_wrong_values")
DEFAULT = Path(__file__).resolve().parents[1] / "tests" / "data" / "cel-spec"


def main() -> None:
    suite = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT
    cases = load_cases(suite)[:: quick(1, 40)]  # quick mode: every 40th case
    reasons: collections.Counter[str] = collections.Counter()
    per_file: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    problems = []
    celpy: collections.Counter[str] = collections.Counter()
    started = time.perf_counter()
    for case in cases:
        reason = protobuf_reason(case)
        if reason is not None:
            reasons[reason] += 1
            per_file[case.file]["n/a"] += 1
            continue
        outcome = run_case(case)
        per_file[case.file][outcome.status] += 1
        celpy[_celpy_conformance.outcome(case).status] += 1
        if outcome.status != "pass":
            problems.append((case, outcome))
    elapsed = time.perf_counter() - started
    print(f"suite: {suite} ({len(cases)} cases, run in {elapsed:.1f} s)")
    print(f"{'file':<18} {'pass':>5} {'fail':>5} {'wrong':>5} {'n/a':>5}")
    for name, counts in sorted(per_file.items()):
        print(f"{name:<18} {counts['pass']:>5} {counts['fail']:>5} {counts['wrong']:>5} {counts['n/a']:>5}")
    print("not applicable (protobuf messages):")
    for reason, n in reasons.most_common():
        print(f"  {n:>4}  {reason}")
    print("applicable cases that do not pass:")
    for case, outcome in problems:
        print(f"  {outcome.status:<5} {case.id}: {outcome.detail[:140]}")
    applicable = sum(counts["pass"] + counts["fail"] + counts["wrong"] for counts in per_file.values())
    passed = sum(counts["pass"] for counts in per_file.values())
    wrong = sum(counts["wrong"] for counts in per_file.values())
    fraction = passed / applicable if applicable else 0.0
    print(f"NexusKV:    {passed} / {applicable} pass ({fraction:.2%}), {wrong} wrong values (applicable cases: the "
          f"suite's size less what needs protobuf messages, a fact of the vendored suite, not a result)")
    print(f"cel-python: {celpy['pass']} / {applicable} pass ({celpy['pass'] / max(applicable, 1):.2%}), "
          f"{celpy['wrong']} wrong values (same cases and comparison; its adapter is in _celpy_conformance.py)")
    print(f"RESULT cel.conformance_pass_fraction {fraction:.4f} >= 0.99")
    print(f"RESULT cel.conformance_wrong_values {wrong} <= 0")


if __name__ == "__main__":
    main()

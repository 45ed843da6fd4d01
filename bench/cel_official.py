"""NexusKV's CEL against Google's own (cel-cpp through `cel-expr-python`) on 10,000+ generated expressions.

    .venv/bin/python bench/cel_official.py | ../shared/tools/check-results cel.official_disagreements

The expressions and their bindings come from the differential grammar of tests/cel/ (typed int, uint, double,
bool, string, list and map variables; arithmetic with overflow, comparisons, `in`, `has`, string methods and
regular expressions, conversions, `dyn`, macros `all` / `exists` / `exists_one` / `map` / `filter`, ternaries,
nested three and four deep) plus the forms only the official CEL shares with NexusKV (the global
`matches(string, string)` and trailing commas in list literals). Each is compiled and evaluated by both; an answer
differs when one refuses the expression and the other does not, one fails at evaluation and the other does not, or
the values (with their CEL types) differ. Every disagreement is printed. Those of a kind docs/cel.md lists, with
the spec's answer and the reason NexusKV keeps its own, are counted apart; the RESULT counts the rest (goal 0).
How many distinct expressions the run compared is its size, fixed by `PER_RUN`, `DEPTHS` and the seeds, so it is
printed as a fact (`distinct expressions: N`), not a RESULT.
What the grammar does not generate, and why, is in docs/cel.md ("Against Google's CEL").
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import quick, requires, result

REPO = Path(__file__).resolve().parents[1]

RESULTS = ("cel.official_disagreements",)
PER_RUN, DEPTHS = quick(4200, 40), quick((3, 4), (3,))  # per kind: a run of PER_RUN cases per nesting depth


def main() -> None:
    try:
        import cel_expr_python  # noqa: F401
    except ImportError:
        requires(False, "cel-expr-python is not installed (the `test` extra)")
        raise
    from hypothesis import HealthCheck, given, seed, settings

    sys.path.insert(0, str(REPO))  # the grammar is the tests' (tests/cel/)
    from tests.cel.official import KINDS, disagreement, expressions, known_reason
    from tests.cel.test_differential import activations

    seen: set[str] = set()
    found: list[tuple[str, str | None]] = []
    started = time.perf_counter()
    def judge(source: str, kind: str, act: dict) -> tuple[str, str | None] | None:
        why = disagreement(source, kind, act)
        return None if why is None else (why, known_reason(why))

    cases = 0
    for kind in KINDS:
        before = len(seen)
        for depth in DEPTHS:  # a fixed seed per depth: the same cases every run
            seed(depth)(_runner(kind, expressions(kind, depth), activations(), seen, found, settings, given,
                                HealthCheck, judge))()  # fmt: skip
            cases += PER_RUN
        print(f"{kind}: {len(seen) - before} distinct expressions")
    print(f"{len(seen)} distinct expressions, {cases} cases (expression and bindings) in "
          f"{time.perf_counter() - started:.1f} s; {len(found)} disagreements")  # fmt: skip
    listed = [w for w, known in found if known is not None]
    kinds = sorted({known for _, known in found if known is not None})
    print(f"of them listed in docs/cel.md: {len(listed)} ({', '.join(kinds) or 'none'}); not listed: "
          f"{len(found) - len(listed)}")  # fmt: skip
    for why, known in found[:50]:
        print(f"  [{known or 'NOT LISTED'}] {why}")
    print(f"distinct expressions: {len(seen):,} (the run's size)")
    result("cel.official_disagreements", len(found) - len(listed), "<=", 0)


def _runner(kind, exprs, acts, seen, found, settings, given, health, judge):
    """One kind's comparison as a hypothesis run that records disagreements instead of failing."""

    @settings(max_examples=PER_RUN, deadline=None, database=None,
              suppress_health_check=list(health))  # fmt: skip
    @given(exprs, acts)
    def compare(source: str, act: dict) -> None:
        seen.add(source)
        got = judge(source, kind, act)
        if got is not None:
            found.append(got)

    return compare


if __name__ == "__main__":
    main()

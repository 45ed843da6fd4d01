"""Condition coverage of policy unit tests (`nexuskv policy test --coverage`).

`opa test --coverage` reports which lines ran; this reports, per policy file and rule, how many test cases
evaluated the rule (cases of its kind against a policy that contains it, inherited rules included, counted at the
file that defines the rule) and how often it fired (every `match` and `when` true). Each boolean condition of its
`match` and `when` expressions, a leaf of their `&&` / `||` / `!` / `? :` structure (a comparison, a `has()`, an
`.exists()` call as a whole, a `variables.x`), is evaluated on its own for every case that reached the rule, with
no short-circuiting, and counted true, false or error. A condition is covered when it was seen true and false; a
rule's decision is covered when its whole `when` was. Literal conditions (`when = "true"`) are not conditions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import lark
from attrs import define

from nexuskv.cel import (
    BOOL,
    CelError,
    CelEvalError,
    Compiled,
    Env,
    FunctionDecl,
    compile_expr,
    parse,
    parse_tree,
    record_type,
)
from nexuskv.policy.authoring.testing import CaseResult, run_tests
from nexuskv.policy.compiler import _locate
from nexuskv.policy.loader import Policies
from nexuskv.policy.policyset import KINDS, CompiledRule, PolicySet, kind_env

__all__ = ["Condition", "Coverage", "CoverageCollector", "FileCoverage", "RuleCoverage", "Totals", "conditions",
           "measure", "render"]  # fmt: skip

_PASS = {"expr", "conditionalor", "conditionaland", "relation", "addition", "multiplication", "unary", "member",
         "primary", "paren_expr"}  # fmt: skip
_TRUE, _FALSE, _ERROR = 0, 1, 2


def conditions(source: str) -> list[tuple[int, int]]:
    """(start, end) offsets in `source` of its conditions, in reading order; raises CelSyntaxError like `parse`."""
    out: list[tuple[int, int]] = []

    def walk(t: lark.Tree) -> None:
        ch = [c for c in t.children if isinstance(c, lark.Tree)]
        if (t.data == "expr" and len(ch) == 3) or (t.data in ("conditionalor", "conditionaland") and len(ch) == 2):
            for c in ch:
                walk(c)
        elif t.data == "unary" and len(ch) == 2 and ch[0].data == "unary_not":
            walk(ch[1])
        elif t.data in _PASS and len(ch) == 1 and len(t.children) == 1:
            walk(ch[0])
        elif t.data != "literal":  # `true` is a constant, not a condition
            out.append((t.meta.start_pos, t.meta.end_pos))

    parse(source)  # raises the CelSyntaxError compiling would
    walk(parse_tree(source))
    return out


@define(frozen=True)
class Condition:
    """One condition of a rule's `match[i]` or `when`, where it is, and how often tests saw it true / false."""

    expression: str
    source: str
    line: int | None
    column: int | None
    expr_line: int
    expr_column: int
    true: int = 0
    false: int = 0
    error: int = 0

    @property
    def covered(self) -> bool:
        """Seen both true and false."""
        return self.true > 0 and self.false > 0

    @property
    def missing(self) -> str:
        """What no test showed: "never evaluated", "never true", "never false" (empty when covered)."""
        return _missing(self.true, self.false) if self.true + self.false + self.error else "never evaluated"


def _missing(true: int, false: int) -> str:
    return ", ".join(m for m, n in (("never true", true), ("never false", false)) if not n)


@define(frozen=True)
class RuleCoverage:
    """One rule: the cases that evaluated it, how they came out, and its conditions."""

    file: str
    kind: str
    name: str
    line: int | None
    evaluated: int
    fired: int
    not_fired: int
    errors: int
    when_true: int
    when_false: int
    when_error: int
    conditions: tuple[Condition, ...]

    @property
    def decision(self) -> bool:
        """Whether `when` is a decision at all (not a constant)."""
        return any(c.expression == "when" for c in self.conditions)

    @property
    def decision_covered(self) -> bool:
        """Its `when` was seen both true and false."""
        return self.when_true > 0 and self.when_false > 0


def _pct(n: int, d: int) -> float:
    return round(100.0 * n / d, 1) if d else 100.0


@define(frozen=True)
class Totals:
    """Counts over some rules; `*_pct` are percentages (100 when there is nothing to cover)."""

    rules: int
    rules_evaluated: int
    rules_fired: int
    conditions: int
    conditions_covered: int
    decisions: int
    decisions_covered: int

    @classmethod
    def of(cls, rules: Sequence[RuleCoverage]) -> Totals:
        """The totals of `rules`."""
        conds = [c for r in rules for c in r.conditions]
        return cls(len(rules), sum(r.evaluated > 0 for r in rules), sum(r.fired > 0 for r in rules), len(conds),
                   sum(c.covered for c in conds), sum(r.decision for r in rules),
                   sum(r.decision and r.decision_covered for r in rules))  # fmt: skip

    @property
    def conditions_pct(self) -> float:
        """Covered conditions, percent (unrounded; 100 when there are none)."""
        return 100.0 * self.conditions_covered / self.conditions if self.conditions else 100.0

    def to_dict(self) -> dict[str, Any]:
        """Counts and percentages (rounded to 0.1)."""
        return {**attrs.asdict(self), "rules_evaluated_pct": _pct(self.rules_evaluated, self.rules),
                "rules_fired_pct": _pct(self.rules_fired, self.rules), "conditions_pct": round(self.conditions_pct, 1),
                "decisions_pct": _pct(self.decisions_covered, self.decisions)}  # fmt: skip


@define(frozen=True)
class FileCoverage:
    """The rules defined in one policy file."""

    file: str
    rules: tuple[RuleCoverage, ...]
    totals: Totals


@define(frozen=True)
class Coverage:
    """Coverage of every rule of every loaded policy by one test run."""

    cases: int
    files: tuple[FileCoverage, ...]
    totals: Totals

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: totals, and per file its totals and rules (each condition with `covered` and `missing`)."""

        def rule(r: RuleCoverage) -> dict[str, Any]:
            d = attrs.asdict(r, recurse=False, filter=lambda a, _: a.name != "conditions")
            d["decision_covered"] = r.decision_covered if r.decision else None
            d["conditions"] = [{**attrs.asdict(c), "covered": c.covered, "missing": c.missing} for c in r.conditions]
            return d

        return {"cases": self.cases, "totals": self.totals.to_dict(),
                "files": [{"file": f.file, "totals": f.totals.to_dict(), "rules": [rule(r) for r in f.rules]}
                          for f in self.files]}  # fmt: skip


class _Counts:
    """What observed cases did to one rule (mutable while collecting)."""

    def __init__(self, rule: CompiledRule) -> None:
        self.rule = rule
        self.runs = [0, 0, 0]  # fired, did not fire, error
        self.when = [0, 0, 0]  # true, false, error
        exprs = [*((f"match[{i}]", i, m.source) for i, m in enumerate(rule.match)), ("when", -1, rule.when.source)]
        # (expression label, match index or -1 for when, condition source, its offset in the expression)
        self.leaves = [(label, i, src[a:b], a) for label, i, src in exprs for a, b in conditions(src)]
        self.outcomes = [[0, 0, 0] for _ in self.leaves]


def _key(rule: CompiledRule) -> tuple[str, str, str]:
    return rule.file, rule.kind, rule.name


def _compile(source: str, env: Env) -> Compiled | None:
    try:
        return compile_expr(source, env, expect=BOOL, cost_limit=10**9)
    except CelError:  # cannot happen for a part of a checked rule; counted as an error if it does
        return None


def _outcome(fn: Compiled | None, act: Mapping[str, Any]) -> int:
    try:
        return _ERROR if fn is None else _TRUE if fn(act) else _FALSE
    except CelEvalError:
        return _ERROR


class CoverageCollector:
    """Pass `observe` to `run_tests` (policy sets of `policies` only); `result()` is the coverage so far.

    `functions` must be the plugin functions the policies were loaded with (conditions compile like the rules).
    """

    def __init__(self, policies: Policies, functions: Mapping[str, FunctionDecl] | None = None) -> None:
        self._functions = dict(functions or {})
        self._cases = 0
        self._rules: dict[tuple[str, str, str], _Counts] = {}
        self._compiled: dict[tuple[str, str], list[tuple[_Counts, list[Compiled | None]]]] = {}
        # Every rule, so that rules no test reaches show up too; an inherited rule counts at the file defining it.
        for rule in (r for _, ps in sorted(policies.sets.items()) for rules in ps.rules.values() for r in rules):
            if _key(rule) not in self._rules:
                self._rules[_key(rule)] = _Counts(rule)

    def _leaves(self, ps: PolicySet, kind: str) -> list[tuple[_Counts, list[Compiled | None]]]:
        """Each rule of `kind` in `ps` with its compiled conditions (in the env its rules were compiled in)."""
        got = self._compiled.get((ps.name, kind))
        if got is None:
            types = {k: f.type for k, f in ps.variables[kind].items()}
            env = kind_env(kind, self._functions).extend({"variables": record_type("variables", types)})
            counts = [self._rules[_key(rule)] for rule in ps.rules[kind]]
            got = [(c, [_compile(leaf[2], env) for leaf in c.leaves]) for c in counts]
            self._compiled[(ps.name, kind)] = got
        return got

    def observe(self, ps: PolicySet, kind: str, values: dict[str, Any]) -> None:
        """Count one evaluated case: every rule of `kind` in `ps`, its `when` and each condition on its own."""
        self._cases += 1
        act = ps.activation(kind, values)  # one activation: each variable is computed once, as in `evaluate`
        for counts, fns in self._leaves(ps, kind):
            rule = counts.rule
            when = _outcome(rule.when, act)
            counts.when[when] += 1
            match = next((o for o in (_outcome(m, act) for m in rule.match) if o != _TRUE), _TRUE)
            counts.runs[match if match != _TRUE else when] += 1  # fired / did not fire / error, like `evaluate`
            for outcome, fn in zip(counts.outcomes, fns, strict=True):
                outcome[_outcome(fn, act)] += 1

    def result(self) -> Coverage:
        """The frozen coverage so far, files sorted by path, rules in file order."""
        texts: dict[str, str | None] = {}
        by_file: dict[str, list[RuleCoverage]] = {}
        for (file, kind, name), c in self._rules.items():
            if file not in texts:
                try:
                    texts[file] = Path(file).read_text()
                except (OSError, UnicodeDecodeError):  # no file positions then, only positions in the expressions
                    texts[file] = None
            by_file.setdefault(file, []).append(_freeze(file, kind, name, c, texts[file]))
        files = []
        for file in sorted(by_file):
            rules = sorted(by_file[file], key=lambda r: (r.line or 0, KINDS.index(r.kind), r.name))
            files.append(FileCoverage(file, tuple(rules), Totals.of(rules)))
        return Coverage(self._cases, tuple(files), Totals.of([r for f in files for r in f.rules]))


def _freeze(file: str, kind: str, name: str, c: _Counts, text: str | None) -> RuleCoverage:
    line = _locate(text, (kind, name, None, None, 0))[0] if text is not None else None
    conds = []
    for (label, index, source, start), (t, f, e) in zip(c.leaves, c.outcomes, strict=True):
        expr = c.rule.when.source if index < 0 else c.rule.match[index].source
        eline = expr.count("\n", 0, start) + 1
        ecol = start - (expr.rfind("\n", 0, start) + 1) + 1
        where = (kind, name, "when" if index < 0 else "match", None if index < 0 else index, 0)
        fline, fcol = _locate(text, where, expr, eline, ecol) if text is not None else (None, None)
        conds.append(Condition(label, source, fline, fcol, eline, ecol, t, f, e))
    fired, not_fired, errors = c.runs
    return RuleCoverage(file, kind, name, line, sum(c.runs), fired, not_fired, errors, *c.when, tuple(conds))


def measure(
    policies: Policies, paths: list[Path], functions: Mapping[str, FunctionDecl] | None = None
) -> tuple[list[CaseResult], Coverage]:
    """Run the tests in `paths` (like `run_tests`) and return their results and coverage."""
    collector = CoverageCollector(policies, functions)
    results = run_tests(policies, paths, observe=collector.observe)
    return results, collector.result()


def _totals_line(t: Totals) -> str:
    d = t.to_dict()
    return (
        f"rules {t.rules_evaluated}/{t.rules} evaluated ({d['rules_evaluated_pct']}%), {t.rules_fired}/{t.rules} "
        f"fired ({d['rules_fired_pct']}%); conditions {t.conditions_covered}/{t.conditions} covered "
        f"({d['conditions_pct']}%); decisions {t.decisions_covered}/{t.decisions} covered ({d['decisions_pct']}%)"
    )


def render(cov: Coverage) -> str:
    """Human-readable report: per file, per rule its counts and each condition's T/F(/E) counts; then totals."""
    lines = [f"coverage of {cov.cases} test case(s):"]
    for f in cov.files:
        lines.append(f"\n{f.file}\n  {_totals_line(f.totals)}")
        for r in f.rules:
            at = f" (line {r.line})" if r.line is not None else ""
            err = f", error {r.errors}" if r.errors else ""
            lines.append(f"  {r.kind} {r.name}{at}: evaluated {r.evaluated}, fired {r.fired}{err}"
                         + ("" if r.evaluated else "  <- no test reaches it"))  # fmt: skip
            if r.decision and r.evaluated:
                miss = _missing(r.when_true, r.when_false)
                err = f", error {r.when_error}" if r.when_error else ""
                lines.append(f"    when: true {r.when_true}, false {r.when_false}{err}{'  <- ' if miss else ''}{miss}")
            for c in r.conditions:
                pos = f"{c.line}:{c.column}" if c.line is not None else f"{c.expression}@{c.expr_line}:{c.expr_column}"
                counts = f"T {c.true} F {c.false}" + (f" E {c.error}" if c.error else "")
                text = " ".join(c.source.split())
                lines.append(f"    {pos:<7} {text}  {counts}" + (f"  <- {c.missing}" if c.missing else ""))
    lines.append(f"\ntotal: {_totals_line(cov.totals)}")
    return "\n".join(lines)

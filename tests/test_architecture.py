"""Imports point one way: every kernel module sits on a floor and imports only from its own floor or below.

The floors are the ones docs/architecture.md draws. A new module must be placed on a floor here (the test fails
for an unplaced module), the import graph must have no cycle, and builtins import only the public `nexuskv` API.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import nexuskv

ROOT = Path(nexuskv.__file__).resolve().parent

FLOORS: list[tuple[str, set[str]]] = [
    ("contracts", {"errors", "units", "logs", "eviction", "hookspecs", "health", "_schema", "_tally", "contracts",
                   "interfaces", "policy.types", "policy.verdict", "policy._celrt", "policy._tomlpos",
                   "policy._celvalues", "policy._textproto", "policy._celtime", "policy._pause", "descriptors"}),
    ("identity and policy", {"identity", "kinds", "holding", "index", "cost", "links", "policy", "policy._celparse",
                             "policy._celcheck", "policy._celconv", "policy._celdyn", "policy._celgen", "policy.cel",
                             "policy._fastpath", "policy.model", "policy.policyset", "policy.compiler",
                             "policy.loader", "policy.explain", "policy.testing", "policy._celstd",
                             "policy._celstdlib", "policy._celext", "policy._celmacros", "policy._celresolve",
                             "policy._celgeneric", "policy._celtyperel", "policy._celcost", "policy._celfold",
                             "policy._cellit", "policy.coverage", "policy.bundle", "policy.live",
                             "policy.conformance", "policy.rollout"}),
    ("decisions", {"planner", "writer", "prefetch", "config", "plugins"}),
    ("kernel parts", {"control", "keying", "decisions", "hierarchy", "sharing", "replay", "shadow", "policyops",
                      "metrics"}),
    ("request paths", {"writepath", "loadpath", "readpath"}),
    ("routing", {"routing"}),
    ("facade", {"kernel"}),
    ("applications", {"", "_demo", "cli", "_cli_rollout", "_cli_impact", "_cli_status", "testing", "stress", "builtins",
                      "builtins.dram", "builtins.local", "builtins.matcher", "builtins.keyer", "builtins.embedded",
                      "builtins.shaped"}),
]  # fmt: skip


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(name: str) -> str:
    """`nexuskv.a.b` -> the kernel module it names ("a.b", or "a" when b is a name inside module a)."""
    rel = name.removeprefix("nexuskv").removeprefix(".")
    while rel and not ((ROOT / rel.replace(".", "/")).with_suffix(".py").exists()
                       or (ROOT / rel.replace(".", "/") / "__init__.py").exists()):  # fmt: skip
        rel = rel.rpartition(".")[0]
    return rel


def imports_of(path: Path) -> set[str]:
    """Kernel modules `path` imports (module level or inside functions)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("nexuskv"):
            for alias in node.names:
                out.add(_resolve(f"{node.module}.{alias.name}"))
        elif isinstance(node, ast.Import):
            out.update(_resolve(a.name) for a in node.names if a.name.startswith("nexuskv"))
    return out


def graph() -> dict[str, set[str]]:
    """Every kernel module and the kernel modules it imports (itself excluded)."""
    return {(m := _module_name(p)): imports_of(p) - {m} for p in sorted(ROOT.rglob("*.py"))}


def problems(deps: dict[str, set[str]], floors: list[tuple[str, set[str]]]) -> list[str]:
    """Unplaced modules, imports that go up a floor, and import cycles."""
    floor_of = {m: i for i, (_, mods) in enumerate(floors) for m in mods}
    out = [f"{m or 'nexuskv'}: not on any floor" for m in deps if m not in floor_of]
    for mod, targets in deps.items():
        for t in sorted(targets):
            if mod in floor_of and t in floor_of and floor_of[t] > floor_of[mod]:
                out.append(f"{mod} ({floors[floor_of[mod]][0]}) imports {t or 'nexuskv'} "
                           f"({floors[floor_of[t]][0]}): a floor above")  # fmt: skip
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(deps.get(m, ())):
            if state.get(t) == 1:
                out.append("import cycle: " + " -> ".join([*stack[stack.index(t):], t]))
            elif t not in state:
                visit(t, [*stack, t])
        state[m] = 2

    for m in sorted(deps):
        if m not in state:
            visit(m, [m])
    return out


def test_imports_point_one_way():
    assert problems(graph(), FLOORS) == []


def test_every_floor_module_exists():
    have = set(graph())
    assert {m for _, mods in FLOORS for m in mods} - have == set()


@pytest.mark.parametrize("module", sorted(m for m in graph() if m.startswith("builtins.")))
def test_builtins_import_only_the_public_api(module):
    assert graph()[module] <= {""}, "builtins are plugins: they import `nexuskv` only"


def test_a_back_import_is_caught():
    floors = [("low", {"a", "b"}), ("high", {"c"})]
    assert problems({"a": {"b"}, "b": set(), "c": {"a"}}, floors) == []
    assert problems({"a": {"c"}, "b": set(), "c": set()}, floors) == ["a (low) imports c (high): a floor above"]
    assert problems({"a": {"b"}, "b": {"a"}, "c": set()}, floors) == ["import cycle: a -> b -> a"]
    assert problems({"a": set(), "b": set(), "c": set(), "d": set()}, floors) == ["d: not on any floor"]

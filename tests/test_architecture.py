"""The kernel's rooms and which way imports point: one floor per room, an order inside each, nothing pointing up.

`FLOORS` is the map docs/architecture.md draws (a test checks the page against it; `python tests/test_architecture.py
--write` rewrites the page's table). Floors go from the bottom up; each is one room of `core/nexuskv/` (a
subpackage), except the package root, which holds the bottom floor (the foundation) and the facade. Inside a floor,
rungs go from the bottom up too. A module may import from a lower floor, a lower rung of its own floor, or its own
rung (without a cycle). The tests fail on an unplaced module, an upward import, a cycle, a room spread over two
floors, an oversized module or folder, and code outside the kernel (plugins, benches, examples) that imports a
private kernel module.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import nexuskv

ROOT = Path(nexuskv.__file__).resolve().parent
REPO = ROOT.parents[1]

# (floor, rungs bottom-up); `room.*` stands for every module of a sub-room (its `__init__` included).
FLOORS: list[tuple[str, list[list[str]]]] = [
    ("foundation", [["errors", "units", "logs", "resources"]]),
    ("contracts", [["contracts.fields", "contracts.schema", "contracts.checksums"],
                   ["contracts.state", "contracts.profile"], ["contracts.request", "contracts.plan"],
                   ["contracts", "contracts.config"], ["contracts.descriptor_codec"]]),
    ("plugins", [["plugins", "plugins.hookspecs", "plugins.interfaces"], ["plugins.manager"]]),
    ("cel", [["cel.types", "cel.values", "cel.textproto"], ["cel.runtime.*"], ["cel.syntax.*"], ["cel.checker.*"],
             ["cel.codegen.*"], ["cel.compiled"], ["cel", "cel.conformance"]]),
    ("policy", [["policy", "policy.model", "policy.verdict", "policy.positions", "policy.pause", "policy.bundle"],
                ["policy.fused_rules", "policy.policyset"], ["policy.compiler"], ["policy.loader"],
                ["policy.sharing", "policy.serving.*", "policy.authoring.*"]]),
    ("state", [["state", "state.holding", "state.restore_points", "state.identity"], ["state.index"],
               ["state.keys"]]),
    ("cluster", [["cluster", "cluster.membership"]]),
    ("planning", [["planning", "planning.breakers", "planning.links", "planning.seal"], ["planning.cost"],
                  ["planning.planner", "planning.budget"], ["planning.decision", "planning.fleet"]]),
    ("ops", [["ops", "ops.counters", "ops.metrics", "ops.lost_gain"], ["ops.capture"], ["ops.replay"], ["ops.shadow"],
             ["ops.decision_log"], ["ops.policy_ops"]]),
    ("storage", [["storage", "storage.eviction", "storage.write_queue", "storage.prefetch", "storage.tier_config",
                  "storage.state_seal", "storage.handoff"],
                 ["storage.hierarchy"]]),
    ("paths", [["paths", "paths.write", "paths.read", "paths.route_types"], ["paths.load", "paths.route"]]),
    ("facade", [["assembly"], ["kernel"], [""]]),
    ("cli", [["cli.demo", "cli.impact", "cli.rollout", "cli.status"], ["cli.commands"], ["cli"]]),
    ("testing", [["testing", "testing.netns"], ["testing.stress"]]),
    ("builtins", [["builtins.*"]]),
]  # fmt: skip
ROOT_FLOORS = ("foundation", "facade")  # the package root's modules: the bottom floor and the facade

PUBLIC_MODULES = {"nexuskv", "nexuskv.cel", "nexuskv.cel.conformance", "nexuskv.cli", "nexuskv.testing",
                  "nexuskv.testing.stress", "nexuskv.testing.netns"}  # fmt: skip
"""What code outside the kernel may import, besides the builtin plugins (`nexuskv.builtins.*`); `test_api` pins it."""

MAX_LINES, MAX_FACADE_LINES, MAX_MODULES_PER_FOLDER = 450, 300, 12


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


def _dotted(node: ast.AST) -> str:
    """`a.b.c` of an attribute chain rooted at a name ("" for anything else)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _imported(tree: ast.AST, package: str | None = None) -> list[str]:
    """Dotted names of every `nexuskv` module a tree reaches, names included, wherever in the tree.

    `from nexuskv.a import b`, `import nexuskv.a`, relative imports (`from ..a import b`, when `package`, the
    dotted package the file is in, is given), `importlib.import_module("nexuskv.a")` / `__import__`, and
    attribute chains such as `nexuskv.a.b` (after `import nexuskv`).
    """
    out: list[str] = []
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # links inside a longer chain
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level and package is not None:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join([*base, *([module] if module else [])])
            if module.split(".")[0] == "nexuskv":
                out.extend(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names if a.name.split(".")[0] == "nexuskv")
        elif isinstance(node, ast.Call) and _dotted(node.func) in ("importlib.import_module", "import_module",
                                                                   "__import__"):  # fmt: skip
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("nexuskv."):
                out.append(arg.value)
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            name = _dotted(node)
            if name.startswith("nexuskv."):
                out.append(name)
    return out


def imports_of(path: Path) -> set[str]:
    """Kernel modules `path` imports."""
    rel = path.relative_to(ROOT).with_suffix("").parts
    package = ".".join(["nexuskv", *(rel if rel[-1] == "__init__" else rel[:-1])]).removesuffix(".__init__")
    return {_resolve(n) for n in _imported(ast.parse(path.read_text()), package)}


def graph() -> dict[str, set[str]]:
    """Every kernel module and the kernel modules it imports (itself excluded)."""
    return {(m := _module_name(p)): imports_of(p) - {m} for p in sorted(ROOT.rglob("*.py"))}


def placement(modules: set[str], floors: list[tuple[str, list[list[str]]]]) -> tuple[dict[str, tuple[int, int]],
                                                                                   list[str]]:  # fmt: skip
    """(module -> (floor, rung), problems: unplaced modules, modules placed twice, entries naming nothing)."""
    where: dict[str, tuple[int, int]] = {}
    problems: list[str] = []
    for f, (floor, rungs) in enumerate(floors):
        for r, rung in enumerate(rungs):
            for entry in rung:
                if entry.endswith(".*"):
                    room = entry[:-2]
                    hits = {m for m in modules if m == room or m.startswith(room + ".")}
                else:
                    hits = {entry} & modules
                if not hits:
                    problems.append(f"{floor}: {entry or 'nexuskv'} names no module")
                for m in sorted(hits):
                    if m in where:
                        problems.append(f"{m or 'nexuskv'}: placed twice")
                    where[m] = (f, r)
    problems += [f"{m or 'nexuskv'}: not on any floor" for m in sorted(modules - set(where))]
    return where, problems


def problems(deps: dict[str, set[str]], floors: list[tuple[str, list[list[str]]]]) -> list[str]:
    """Unplaced modules, imports that go up a floor or a rung, and import cycles."""
    where, out = placement(set(deps), floors)
    for mod, targets in deps.items():
        for t in sorted(targets):
            if mod in where and t in where and where[t] > where[mod]:
                f, tf = where[mod][0], where[t][0]
                up = "a floor above" if tf > f else "a rung above"
                out.append(f"{mod or 'nexuskv'} ({floors[f][0]}) imports {t or 'nexuskv'} ({floors[tf][0]}): {up}")
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


def room_of(module: str) -> str:
    """The top-level room a module lives in ("" for the package root)."""
    return module.split(".")[0] if "." in module or (ROOT / module / "__init__.py").exists() else ""


def test_imports_point_one_way():
    assert problems(graph(), FLOORS) == []


def test_each_room_is_one_floor():
    where, _ = placement(set(graph()), FLOORS)
    floors_of: dict[str, set[str]] = {}
    for m, (f, _) in where.items():
        floors_of.setdefault(room_of(m), set()).add(FLOORS[f][0])
    assert floors_of.pop("") == set(ROOT_FLOORS)
    assert {room: names for room, names in floors_of.items() if names != {room}} == {}


def test_module_and_folder_sizes():
    lines = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert {p: n for p, n in lines.items() if n > MAX_LINES} == {}
    assert lines["kernel.py"] < MAX_FACADE_LINES
    folders: dict[str, int] = {}
    for p in lines:
        folders[str(Path(p).parent)] = folders.get(str(Path(p).parent), 0) + 1
    assert {d: n for d, n in folders.items() if n > MAX_MODULES_PER_FOLDER} == {}


@pytest.mark.parametrize("module", sorted(m for m in graph() if m.startswith("builtins.")))
def test_builtins_import_only_the_public_api(module):
    assert graph()[module] <= {""}, "builtins are plugins: they import `nexuskv` only"


def test_the_policy_layer_uses_the_cel_engine_through_its_public_api():
    """`nexuskv.cel` is a library: no kernel module outside it reaches into its insides."""
    inside = {m: {t for t in ts if t.startswith("cel.") and t != "cel.conformance"}
              for m, ts in graph().items() if not m.startswith("cel")}  # fmt: skip
    assert {m: ts for m, ts in inside.items() if ts} == {}


def private_imports(paths: list[Path]) -> dict[str, list[str]]:
    """File -> the private kernel modules it imports (anything but `PUBLIC_MODULES` and the builtin plugins)."""
    out: dict[str, list[str]] = {}
    for path in paths:
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:  # pragma: no cover - a file that does not parse fails its own tests
            continue
        bad = sorted({f"nexuskv.{m}" for n in _imported(tree) if (m := _resolve(n)) is not None
                      and f"nexuskv.{m}".removesuffix(".") not in PUBLIC_MODULES and not m.startswith("builtins")}
                     | {n for n in _imported(tree) if n.rpartition(".")[2].startswith("_")
                        and n.rpartition(".")[2] != "__version__"})  # a private name of a public module
        if bad:
            out[path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)] = bad
    return out


def test_the_tests_mirror_the_rooms():
    """`tests/<room>/test_<module>.py` (sub-rooms nested likewise); the root's modules are tested in `tests/`."""
    tests = REPO / "tests"
    folders = {d.relative_to(tests).as_posix() for d in tests.rglob("*") if d.is_dir()
               and d.name not in ("__pycache__", "data") and "data" not in d.relative_to(tests).parts}  # fmt: skip
    rooms = {d.relative_to(ROOT).as_posix() for d in ROOT.rglob("*") if (d / "__init__.py").is_file()}
    assert folders - rooms == set()
    assert all((tests / f / "__init__.py").is_file() for f in folders)


def test_plugins_benches_and_examples_import_only_public_modules():
    files = [p for d in ("plugins", "bench", "examples") for p in sorted((REPO / d).rglob("*.py"))
             if ".venv" not in p.parts and "target" not in p.parts]  # fmt: skip
    assert len(files) > 50
    assert private_imports(files) == {}


def test_a_private_import_is_caught(tmp_path):
    f = tmp_path / "plugin.py"
    f.write_text("from nexuskv import Kernel\nfrom nexuskv.cel import compile_expr\nimport nexuskv.builtins.dram\n"
                 "from nexuskv.cli import main\n"
                 "def later():\n    from nexuskv.planning.cost import CostModel\n    from nexuskv.cli import _x\n"
                 "    importlib.import_module('nexuskv.state.keys')\n    return nexuskv.paths.read.ReadPath\n")
    assert list(private_imports([f]).values()) == [["nexuskv.cli._x", "nexuskv.paths.read", "nexuskv.planning.cost",
                                                     "nexuskv.state.keys"]]


def test_relative_imports_are_read():
    assert _imported(ast.parse("from .. import kernel\nfrom .write import WritePath\n"), "nexuskv.paths") == [
        "nexuskv.kernel", "nexuskv.paths.write.WritePath"]


DISTRIBUTIONS = sorted(p.parent for p in (REPO / "plugins").glob("*/pyproject.toml"))
GRAB_BAGS = {"private", "misc", "util", "utils", "helpers", "common", "stuff"}  # names that say nothing held


def plugin_problems(dist: Path) -> list[str]:
    """How a plugin distribution departs from the one pattern: a README, an entry point to `<package>.plugin`,
    a `plugin.py` that holds hooks only, and private modules named by what they hold (no `_private.py`)."""
    import tomllib

    out: list[str] = []
    name = dist.name
    if not (dist / "README.md").is_file():
        out.append(f"{name}: no README.md")
    eps = tomllib.loads((dist / "pyproject.toml").read_text()).get("project", {}).get("entry-points", {})
    targets = list(eps.get("nexuskv", {}).values())
    if len(targets) != 1 or not targets[0].endswith(".plugin"):
        out.append(f"{name}: the nexuskv entry point must name <package>.plugin (has {targets})")
        return out
    pkg = dist / targets[0].removesuffix(".plugin").replace(".", "/")
    if not (pkg / "plugin.py").is_file():
        return [*out, f"{name}: no {targets[0].replace('.', '/')}.py"]
    for grab_bag in sorted(p for p in pkg.rglob("*") if p.stem.lstrip("_") in GRAB_BAGS):
        out.append(f"{name}: {grab_bag.relative_to(dist)}: name a private module by what it holds")
    tree = ast.parse((pkg / "plugin.py").read_text())
    for node in tree.body:
        hook = isinstance(node, ast.FunctionDef) and any(
            "hookimpl" in (_dotted(d.func if isinstance(d, ast.Call) else d).split(".")[-1:] or [""])
            for d in node.decorator_list)  # fmt: skip
        doc = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        dunder_all = (isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["__all__"]) or (
            isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "__all__")
        if not (hook or doc or dunder_all or isinstance(node, (ast.Import, ast.ImportFrom))):
            what = getattr(node, "name", type(node).__name__)
            out.append(f"{name}: plugin.py holds {what} (only hooks belong there: move it to a module of its role)")
        elif hook:
            nested = [n.name for n in ast.walk(node) if n is not node
                      and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]  # fmt: skip
            out.extend(f"{name}: plugin.py: hook {node.name} defines {n} (move it to a module of its role)"
                       for n in nested)  # fmt: skip
    return out


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=[d.name for d in DISTRIBUTIONS])
def test_plugins_follow_one_pattern(dist):
    assert plugin_problems(dist) == []


def test_a_plugin_off_the_pattern_is_caught(tmp_path):
    dist = tmp_path / "nexuskv-x"
    (dist / "nexuskv_x").mkdir(parents=True)
    (dist / "pyproject.toml").write_text('[project.entry-points.nexuskv]\nx = "nexuskv_x.plugin"\n')
    (dist / "nexuskv_x" / "_private.py").write_text("")
    (dist / "nexuskv_x" / "_misc").mkdir()
    (dist / "nexuskv_x" / "plugin.py").write_text(
        "import nexuskv\nfrom nexuskv import hookimpl\n\n@hookimpl\ndef nexuskv_x(): ...\n"
        "@nexuskv.hookimpl(tryfirst=True)\ndef nexuskv_y():\n    class Store: ...\n    return Store\n"
        "def helper(): ...\n")  # fmt: skip
    assert plugin_problems(dist) == [
        "nexuskv-x: no README.md",
        "nexuskv-x: nexuskv_x/_misc: name a private module by what it holds",
        "nexuskv-x: nexuskv_x/_private.py: name a private module by what it holds",
        "nexuskv-x: plugin.py: hook nexuskv_y defines Store (move it to a module of its role)",
        "nexuskv-x: plugin.py holds helper (only hooks belong there: move it to a module of its role)",
    ]
    (dist / "nexuskv_x" / "plugin.py").unlink()
    assert plugin_problems(dist)[-1] == "nexuskv-x: no nexuskv_x/plugin.py"


def test_a_back_import_is_caught():
    floors = [("low", [["a"], ["b"]]), ("high", [["c"]])]
    assert problems({"a": set(), "b": {"a"}, "c": {"a", "b"}}, floors) == []
    assert problems({"a": {"c"}, "b": set(), "c": set()}, floors) == ["a (low) imports c (high): a floor above"]
    assert problems({"a": {"b"}, "b": set(), "c": set()}, floors) == ["a (low) imports b (low): a rung above"]
    assert problems({"a": set(), "b": {"b2"}, "b2": {"b"}, "c": set()},
                    [("low", [["a"], ["b", "b2"]]), ("high", [["c"]])]) == ["import cycle: b -> b2 -> b"]
    assert problems({"a": set(), "b": set(), "c": set(), "d": set()}, floors) == ["d: not on any floor"]


# ------------------------------------------------------------------------------------------ the page's table

BEGIN, END = "<!-- floors: begin (generated from tests/test_architecture.py) -->", "<!-- floors: end -->"
DOC = REPO / "docs" / "architecture.md"


def _summary(module: str) -> str:
    path = (ROOT / module.replace(".", "/") / "__init__.py") if (ROOT / module.replace(".", "/")).is_dir() \
        else (ROOT / module.replace(".", "/")).with_suffix(".py")  # fmt: skip
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")


def floors_table() -> str:
    """The markdown table of every floor, rung and module, each with the first paragraph of its docstring."""
    modules = set(graph())
    where, _ = placement(modules, FLOORS)
    rows = ["| floor | rung | module | what it holds |", "| --- | --- | --- | --- |"]
    for f, (floor, rungs) in enumerate(FLOORS):
        for r in range(len(rungs)):
            for m in sorted((m for m, pos in where.items() if pos == (f, r)), key=lambda m: (m.count("."), m)):
                path = "nexuskv/" + (m.replace(".", "/") + ("/__init__.py" if (ROOT / m.replace(".", "/")).is_dir()
                                                            else ".py") if m else "__init__.py")  # fmt: skip
                rows.append(f"| {f} {floor} | {r} | `{path}` | {_summary(m)} |")
    return "\n".join(rows)


def test_the_architecture_page_draws_these_floors():
    text = DOC.read_text()
    assert BEGIN in text and END in text
    drawn = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()
    assert drawn == floors_table(), "run `.venv/bin/python tests/test_architecture.py --write`"


if __name__ == "__main__":  # rewrite the page's table from FLOORS and the modules' docstrings
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python tests/test_architecture.py --write")
    text = DOC.read_text()
    i, j = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:i] + "\n" + floors_table() + "\n" + text[j:])

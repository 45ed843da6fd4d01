"""Load a policy directory: TOML files validated against the schema, `extends` resolved, every CEL checked.

`Policies.load(dir)` reads `default.toml` and `tenants/*.toml`, and raises one `PolicyError` listing every
problem (file, rule, line and column) at once; nothing half-loaded is ever used. `Policies.for_tenant(name)`
returns the compiled `PolicySet` of a tenant (the default one for tenants without a file).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from attrs import define, field

from nexuskv.contracts import schema
from nexuskv.errors import ContractError, NexusKVError, did_you_mean
from nexuskv.policy import positions
from nexuskv.policy.bundle import PolicyBundle, bundle_revision, policy_files
from nexuskv.policy.compiler import compile_policy
from nexuskv.policy.model import PolicyFile
from nexuskv.policy.pause import pause
from nexuskv.policy.policyset import KINDS, PolicySet, RuleSource

__all__ = ["Policies", "PolicyError", "PolicyProblem", "parse_policy_file", "parse_policy_text"]

DEFAULT = "default"
NO_PARENT = "none"
_READER_CACHE = 4096  # readers whose shared scopes a revision remembers


@define(frozen=True)
class PolicyProblem:
    """One problem in one policy file, as precisely located as the input allows."""

    file: str
    message: str
    rule: str = ""
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}" + (f":{self.column}" if self.column is not None else "")
        return f"{where}: {f'rule {self.rule}: ' if self.rule else ''}{self.message}"


class PolicyError(NexusKVError):
    """Policies failed to load; `problems` lists every one found."""

    def __init__(self, problems: Iterable[PolicyProblem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


def _line_of_key(text: str, path: str) -> tuple[int | None, int | None]:
    """Line and column of a schema path like `admit[2].effct`, `variables.x` or `extends` in TOML text."""
    scan = positions.Strings(text)
    headers = list(re.finditer(r"(?m)^[ \t]*\[", scan.masked))
    top_end = headers[0].start() if headers else len(text)
    m = re.match(r"^(\w+)\[(\d+)\](?:\.(\w+))?", path)
    if m:
        kind, idx, key = m.group(1), int(m.group(2)), m.group(3)
        blocks = [(h.start(), headers[n + 1].start() if n + 1 < len(headers) else len(text))
                  for n, h in enumerate(headers)
                  if re.match(rf"[ \t]*\[\[[ \t]*{re.escape(kind)}[ \t]*\]\]", scan.masked[h.start():])]  # fmt: skip
        if idx < len(blocks):
            start, end = blocks[idx]
            pos = positions.key_offset(scan, key, start, end) if key else None
            return positions.file_position(text, pos if pos is not None else _first_char(scan, start))
    head, _, key = path.partition(".")
    head = head.split("[")[0]
    if key:  # a key of a table: `variables.x`
        block = positions.table_block(scan, head)
        if block is not None:
            pos = positions.key_offset(scan, key.split(".")[0].split("[")[0], *block)
            return positions.file_position(text, pos if pos is not None else _first_char(scan, block[0]))
    pos = positions.key_offset(scan, head, 0, top_end)
    if pos is None:  # a table header: `[evict]`, `[[evict]]`
        hm = re.search(rf"(?m)^[ \t]*\[\[?[ \t]*{re.escape(head)}[ \t]*\]", scan.masked)
        pos = hm.start() + len(hm.group(0)) - len(hm.group(0).lstrip()) if hm else None
    return positions.file_position(text, pos) if pos is not None else (None, None)


def _first_char(scan: positions.Strings, start: int) -> int:
    """Offset of the first non-blank character at or after `start` (the `[` of a header)."""
    m = re.compile(r"[ \t]*").match(scan.masked, start)
    return m.end() if m else start


def parse_policy_file(path: Path) -> tuple[PolicyFile | None, list[PolicyProblem], str]:
    """Read and validate one file; return (model or None, problems, text)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        return None, [PolicyProblem(str(path), f"cannot read: {getattr(exc, 'strerror', None) or exc}")], ""
    return parse_policy_text(text, str(path), path.stem)


def parse_policy_text(text: str, name: str, stem: str) -> tuple[PolicyFile | None, list[PolicyProblem], str]:
    """Validate one policy file's text (`name` is what problems call it, `stem` its default policy name).

    Remembered (the model is immutable): a reload parses again only the files that changed.
    """
    model, problems, _ = _parse_text(text, name, stem)
    return model, list(problems), text


@functools.lru_cache(maxsize=512)
def _parse_text(text: str, name: str,
                stem: str) -> tuple[PolicyFile | None, tuple[PolicyProblem, ...], PolicyFile | None]:  # fmt: skip
    """The model (None on problems), the problems, and the file less its bad keys (to find its CEL problems too)."""
    model, problems, salvaged = _parse_uncached(text, name, stem)
    return model, tuple(problems), salvaged


def _kept(p: dict[str, Any], salvaged: Mapping[str, set[str]]) -> bool:
    """False for a problem that only follows from the keys a salvaged file lost (a rule missing its removed weight).

    A CEL expression's own problem is kept: it is the file's, whatever else is wrong with it.
    """
    rules = salvaged.get(p["file"])
    return bool(p.get("cel")) or rules is None or p["rule"] not in rules


_PATH_PART = re.compile(r"\.?([A-Za-z_]\w*)|\[(\d+)\]")


def _salvage(data: Mapping[str, Any], paths: Sequence[str], stem: str) -> PolicyFile | None:
    """`data` less every key of `paths` (its structural problems), validated; None when that does not validate.

    Only ever compiled to report the file's CEL problems beside its structural ones: a file with problems is never
    used.
    """
    data = copy.deepcopy(data)
    for path in paths:
        parts: list[str | int] = []
        at = 0
        while at < len(path):
            m = _PATH_PART.match(path, at)
            if m is None:
                return None  # a quoted or odd key: not worth guessing
            parts.append(m.group(1) if m.group(1) is not None else int(m.group(2)))
            at = m.end()
        parent: Any = data
        for part in parts[:-1]:
            try:
                parent = parent[part]
            except (KeyError, IndexError, TypeError):
                return None
        if not isinstance(parent, dict) or parts[-1] not in parent:
            return None
        del parent[parts[-1]]
    try:
        model = schema.structure(PolicyFile, data)
    except ContractError:
        return None
    if model.name not in ("", stem):
        return None
    return attrs.evolve(model, name=stem)


def _parse_uncached(text: str, name: str,
                    stem: str) -> tuple[PolicyFile | None, list[PolicyProblem], PolicyFile | None]:  # fmt: skip
    """(model, [], None), or (None, problems, the salvaged file when structural problems allow one)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(exc))
        msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(exc))
        line, col = (int(m.group(1)), int(m.group(2))) if m else (None, None)
        return None, [PolicyProblem(name, f"TOML syntax error: {msg}", line=line, column=col)], None
    pause()
    try:
        model = schema.structure(PolicyFile, data)
    except ContractError as exc:
        problems = []
        for p, msg in exc.problems:
            line, col = _line_of_key(text, p)
            if msg.startswith("unknown field") and "." not in p and "[" not in p and _is_table_array(data.get(p)):
                msg = f"unknown rule kind{did_you_mean(p, KINDS)} (one of {', '.join(KINDS)})"
            rule = _rule_at(data, p)
            problems.append(PolicyProblem(name, f"{p}: {msg}", rule=rule, line=line, column=col))
        return None, problems, _salvage(data, [p for p, _ in exc.problems], stem)
    if not model.name:
        model = attrs.evolve(model, name=stem)
    elif model.name != stem:  # loaded under the other name, it would never apply to the tenant the file is named for
        line, col = _line_of_key(text, "name")
        return None, [PolicyProblem(name, f'name "{model.name}" differs from the file name "{stem}", so this policy '
                                    f'would never apply as "{stem}": rename the file to {model.name}.toml, or set '
                                    f'name = "{stem}" (or leave name out)', line=line, column=col)], None  # fmt: skip
    return model, [], None


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _rule_at(data: Mapping[str, Any], path: str) -> str:
    m = re.match(r"^(admit|reuse|place|share|route)\[(\d+)\]", path)
    if not m:
        return ""
    rules = data.get(m.group(1))
    try:
        rule = rules[int(m.group(2))]  # type: ignore[index]
        return str(rule.get("name", "")) if isinstance(rule, dict) else ""
    except (IndexError, TypeError, KeyError):
        return ""


@define
class _Loaded:
    model: PolicyFile
    path: Path
    text: str
    revision: str


@define
class Policies:
    """Every policy of a directory, compiled: the default and one `PolicySet` per tenant file."""

    root: Path
    sets: dict[str, PolicySet] = field(factory=dict)
    revision: str = ""
    _shares: dict[str, tuple[tuple[str, str, PolicySet], ...]] = field(factory=dict, init=False, repr=False, eq=False)

    @classmethod
    def load(cls, root: str | Path, functions: Mapping[str, Any] | None = None) -> Policies:
        """Load and compile `root`; raise `PolicyError` with every problem found."""
        policies, problems = cls._load(Path(root), functions or {})
        if problems:
            raise PolicyError(problems)
        return policies

    @classmethod
    def check(cls, root: str | Path, functions: Mapping[str, Any] | None = None) -> list[PolicyProblem]:
        """Every problem of a policy directory (empty when it loads cleanly)."""
        return cls._load(Path(root), functions or {})[1]

    @classmethod
    def from_bundle(cls, bundle: PolicyBundle, functions: Mapping[str, Any] | None = None) -> Policies:
        """Load and compile a bundle's files (problems name them `bundle:<revision>/<path>`); raise `PolicyError`."""
        policies, problems = cls.check_bundle(bundle, functions)
        if problems:
            raise PolicyError(problems)
        return policies

    @classmethod
    def check_bundle(cls, bundle: PolicyBundle, functions: Mapping[str, Any] | None = None,
                     ) -> tuple[Policies, list[PolicyProblem]]:  # fmt: skip
        """A bundle compiled, and every problem found (the policies are unusable unless the list is empty)."""
        origin = f"bundle:{bundle.revision}"
        entries = [(f"{origin}/{rel}", rel, text) for rel, text in bundle.files.items()]
        return cls._compile(Path(origin), entries, functions or {})

    @classmethod
    def _load(cls, root: Path, functions: Mapping[str, Any]) -> tuple[Policies, list[PolicyProblem]]:
        if not root.is_dir():
            where = "" if root.is_absolute() else f" (a relative path is read from the current directory, {Path.cwd()})"
            return cls(root), [PolicyProblem(str(root), f"no such policy directory{where}")]
        entries: list[tuple[str, str, str]] = []
        problems: list[PolicyProblem] = []
        for path in policy_files(root):
            try:
                entries.append((str(path), path.relative_to(root).as_posix(), path.read_text()))
            except (OSError, UnicodeDecodeError) as exc:
                problems.append(PolicyProblem(str(path), f"cannot read: {getattr(exc, 'strerror', None) or exc}"))
        policies, more = cls._compile(root, entries, functions)
        return policies, problems + more

    @classmethod
    def _compile(cls, root: Path, entries: Sequence[tuple[str, str, str]],
                 functions: Mapping[str, Any]) -> tuple[Policies, list[PolicyProblem]]:  # fmt: skip
        """Compile `(name for problems, relative path, text)` entries; the revision is the bundle revision."""
        problems: list[PolicyProblem] = []
        if not entries:
            problems.append(PolicyProblem(str(root), "no policy files (expected default.toml, tenants/*.toml)"))
        loaded: dict[str, _Loaded] = {}
        broken: set[str] = set()  # files with structural problems: compiled only to list their CEL problems too
        salvaged: dict[str, set[str]] = {}  # such a file -> the rules that had a structural problem
        for name, rel, text in entries:
            pause()
            model, probs, salvage = _parse_text(text, name, Path(rel).stem)
            problems.extend(probs)
            if model is None:
                if salvage is None or salvage.name in loaded:
                    continue
                model = salvage
                broken.add(model.name)
                salvaged[name] = {p.rule for p in probs}
            if model.name in loaded:
                line, col = _line_of_key(text, "name")
                problems.append(PolicyProblem(name, f"policy {model.name!r} is also defined in "
                                              f"{loaded[model.name].path}", line=line, column=col))  # fmt: skip
                continue
            rev = hashlib.sha256(text.encode()).hexdigest()[:16]
            loaded[model.name] = _Loaded(model, Path(name), text, rev)
        sets: dict[str, PolicySet] = {}
        for name in loaded:
            pause()
            chain, err = _chain(name, loaded)
            if err is not None:
                problems.append(err)
                continue
            sources = [RuleSource(loaded[n].model, str(loaded[n].path), loaded[n].text, loaded[n].revision)
                       for n in chain]  # fmt: skip
            ps, probs = compile_policy(sources, functions)
            problems.extend(PolicyProblem(**{k: v for k, v in d.items() if k != "cel"}) for d in probs
                            if _kept(d, salvaged))  # fmt: skip
            if ps is not None and not broken.intersection(chain):
                sets[name] = ps
        # A problem in a parent shows once per child: report each exactly once.
        unique = list(dict.fromkeys(problems))
        revision = bundle_revision({rel: text for _, rel, text in entries})
        return cls(root, sets, revision), unique

    def for_tenant(self, tenant: str) -> PolicySet:
        """The tenant's policy set, or the default one when the tenant has no file."""
        got = self.sets.get(tenant) or self.sets.get(DEFAULT)
        if got is None:
            raise PolicyError([PolicyProblem(str(self.root), f"no policy for tenant {tenant!r} and no default")])
        return got

    def tenants(self) -> list[str]:
        """Names of the loaded policies."""
        return sorted(self.sets)

    def readable_by(self, reader: str) -> list[tuple[str, str]]:
        """`(owner, scope)` of every other tenant's scope a `share` rule names `reader` (or `*`) for.

        Static: the owner's `share` rule is still evaluated per request (its `when`, its effect).
        """
        return [(owner, scope) for owner, scope, _ in self.shared_with(reader)]

    def shared_with(self, reader: str) -> tuple[tuple[str, str, PolicySet], ...]:
        """`(owner, scope, owner's policy)` of every scope `readable_by(reader)`: what a plan of `reader` hands on.

        Resolved once per revision and reader (at most `_READER_CACHE` readers are remembered: tenant names are the
        callers' strings); the owner's `share` rules are still evaluated per request.
        """
        got = self._shares.get(reader)
        if got is None:
            found: dict[tuple[str, str], PolicySet] = {}
            for owner, ps in sorted(self.sets.items()):
                if owner not in (reader, DEFAULT):
                    for _, scope in ps.grants(reader):
                        found.setdefault((owner, scope), ps)
            if len(self._shares) >= _READER_CACHE:
                self._shares.clear()
            got = self._shares[reader] = tuple((o, s, ps) for (o, s), ps in found.items())
        return got

def _chain(name: str, loaded: Mapping[str, _Loaded]) -> tuple[list[str], PolicyProblem | None]:
    """[name, parent, grandparent, ...]; a cycle or a missing parent is a problem of the file that names it."""
    chain = [name]
    while True:
        cur = loaded[chain[-1]]
        parent = cur.model.extends or (DEFAULT if cur.model.name != DEFAULT else "")
        if parent in ("", NO_PARENT) or (parent == DEFAULT and DEFAULT not in loaded and not cur.model.extends):
            return chain, None
        line, col = _line_of_key(cur.text, "extends")
        if parent not in loaded:
            return chain, PolicyProblem(str(cur.path), f"extends {parent!r}: no such policy "
                                        f"(have: {', '.join(sorted(loaded))})", line=line, column=col)  # fmt: skip
        if parent in chain:
            cycle = " -> ".join([*chain[chain.index(parent):], parent])
            return chain, PolicyProblem(str(cur.path), f"extends {parent!r}: cycle {cycle}", line=line, column=col)
        chain.append(parent)

"""One kind of a policy (all its rules) compiled into a single generated Python function.

Rule conditions, caps, messages and placements are inlined into one frame, and the verdict is built by code
specialised to each rule's effect, so evaluating a 10-rule tenant costs about what hand-written Python does.
When anything raises, the generated function hands the activation to the exact, rule-by-rule evaluator.
"""

from __future__ import annotations

import datetime as _dt
import io
import re
import tokenize
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nexuskv.cel import Compiled, helper_globals, inline
from nexuskv.policy.pause import pause
from nexuskv.policy.verdict import Placement, Verdict

__all__ = ["UNSET", "build"]

_U = UNSET = object()  # a variable not computed yet


_VARIABLES_HOIST = re.compile(r"^(\S+) = A\['variables'\]$")


class _Code:
    """Accumulates inlined expressions, their hoists and constants.

    `variables.NAME` becomes a local computed on first use, at most once per call:
    `(_vv_NAME if _vv_NAME is not _U else (_vv_NAME := <NAME's code>))`.
    """

    def __init__(self, variables: Mapping[str, Compiled]) -> None:
        self.hoists: list[str] = []
        self.consts: dict[str, Any] = {}
        self.n = 0
        self.variables = variables
        self.used: list[str] = []  # variables referenced, in first-use order
        self.needs_object = False  # some code still reads the `variables` value itself (has(), say)
        self._var_code: dict[str, str] = {}

    def expr(self, c: Compiled) -> str:
        code, hoists, consts = inline(c, f"_x{self.n}")
        self.n += 1
        self.consts.update(consts)
        for h in hoists:
            m = _VARIABLES_HOIST.match(h)
            if m:
                code = self._substitute(code, m.group(1))
                if re.search(rf"\b{re.escape(m.group(1))}\b", code):
                    self.needs_object = True
                    self.hoists.append(h)
            else:
                self.hoists.append(h)
        return code

    def _substitute(self, code: str, vname: str) -> str:
        toks = list(tokenize.generate_tokens(io.StringIO(code).readline))
        out: list[tuple[int, str]] = []
        i = 0
        while i < len(toks):
            t = toks[i]
            if (t.type == tokenize.NAME and t.string == vname and i + 2 < len(toks) and toks[i + 1].string == "."
                    and toks[i + 2].type == tokenize.NAME and toks[i + 2].string in self.variables):  # fmt: skip
                name = toks[i + 2].string
                local = f"_vv_{name}"
                lazy = f"({local} if {local} is not _U else ({local} := {self._variable(name)}))"
                out.extend((tok.type, tok.string) for tok in tokenize.generate_tokens(io.StringIO(lazy).readline)
                           if tok.type not in (tokenize.NEWLINE, tokenize.ENDMARKER))  # fmt: skip
                i += 3
                continue
            out.append((t.type, t.string))
            i += 1
        return tokenize.untokenize(out).strip()

    def _variable(self, name: str) -> str:
        if name not in self._var_code:
            self._var_code[name] = "None"  # a cycle cannot happen (variables only use earlier ones)
            self._var_code[name] = self.expr(self.variables[name])
            self.used.append(name)
        return self._var_code[name]

    def const(self, value: Any) -> str:
        name = f"_c{len(self.consts)}_"
        self.consts[name] = value
        return name


def build(
    kind: str,
    rules: Sequence[Any],
    *,
    policy: str,
    revision: str,
    default_tier: str,
    variables_class: type | None,
    variables: Mapping[str, Compiled],
    uses_now: bool,
    slow: Callable[[Mapping[str, Any], tuple[tuple[str, Any], ...]], Verdict],
) -> Callable[[Mapping[str, Any]], Verdict]:
    """The generated evaluator of one kind (`admit`, `reuse` or `place`).

    On any exception it calls `slow(activation, computed)`, where `computed` pairs each variable name with its
    value, or `_U` when it was not computed: the slow path reuses those, so a variable is still computed once.
    """
    code = _Code(variables)
    lines = ["def _evaluate(values):"]
    body: list[str] = []
    name, rev = code.const(policy), code.const(revision)
    if kind == "place":  # first firing rule wins: an if-chain that stops there
        body = _place(rules, code, name, rev, default_tier)
    for i, r in enumerate(rules if kind != "place" else ()):
        cond = " and ".join([*(code.expr(m) for m in r.match), code.expr(r.when)])
        body.append(f"f{i} = {cond}")
        extras = {"m": r.message_fn, "k": r.max_tokens}
        for tag, fn in extras.items():
            if fn is not None:
                body.append(f"{tag}{i} = {code.expr(fn)} if f{i} else None")
    needs_object = code.needs_object and variables_class is not None
    if not needs_object and not uses_now:  # read the caller's mapping as it is when it has a node
        lines += ["    if 'node' in values:", "        A = values", "    else:", "        A = dict(values)",
                  "        A['node'] = ''"]  # fmt: skip
    else:
        lines += ["    A = dict(values)", "    if 'node' not in A:", "        A['node'] = ''"]
    if uses_now:
        lines += ["    if 'now' not in A:", "        A['now'] = _now()"]
    if needs_object:
        lines += ["    V = _obj_new(_Vars)", "    V._act = A", "    A['variables'] = V"]
    lines += [f"    _vv_{v} = _U" for v in code.used]
    if kind == "place":
        lines += ["    fired = []", "    audits = []"]
    lines += ["    try:", "        pass"]
    lines += [f"        {h}" for h in code.hoists]
    lines += [f"        {b}" for b in body]
    known = ", ".join(f"({n!r}, _vv_{n})" for n in code.used)
    lines += ["    except Exception:", f"        return _slow(A, ({known}{',' if code.used else ''}))"]
    flags = " or ".join(f"f{i}" for i in range(len(rules))) or "False"
    if kind != "place":
        lines += [f"    if not ({flags}):", "        return _QUIET"]
        lines += _decide(rules, code, kind, name, rev)
    g = helper_globals(code.consts)
    g.update({"_slow": slow, "_Vars": variables_class, "_obj_new": object.__new__, "_new": tuple.__new__, "_U": _U,
              "_Verdict": Verdict,
              "_Placement": Placement, "_now": lambda: _dt.datetime.now(_dt.UTC),
              "_QUIET": Verdict(kind, policy, revision, allowed=True)})  # fmt: skip
    pause()  # the source is built; compiling it is the next step of a reload
    exec(compile("\n".join(lines) + "\n", f"<policy {policy} {kind}>", "exec"), g)
    fn: Callable[[Mapping[str, Any]], Verdict] = g["_evaluate"]
    return fn


def _decide(rules: Sequence[Any], code: _Code, kind: str, name: str, rev: str) -> list[str]:
    out = ["    fired = []", "    deciding = []", "    messages = []", "    warnings = []", "    audits = []",
           "    allowed = True", "    cap = None"]  # fmt: skip
    for i, r in enumerate(rules):
        rn = code.const(r.name)
        msg = f"str(m{i})" if r.message_fn is not None else code.const(r.message)
        has_msg = r.message_fn is not None or bool(r.message)
        out += [f"    if f{i}:", f"        fired.append({rn})"]
        if r.effect == "deny":
            out.append(f"        deciding.append({rn})")
            if has_msg:
                out.append(f"        messages.append({msg})")
            if r.max_tokens is None:
                out += ["        allowed = False", "        cap = 0"]
            else:
                out += [f"        lim = max(0, int(k{i}))", "        cap = lim if cap is None else min(cap, lim)",
                        "        if cap == 0:", "            allowed = False"]  # fmt: skip
        else:
            target = "warnings" if r.effect == "warn" else "audits"
            text = f"{rn} + ': ' + {msg}" if has_msg else rn
            out.append(f"        {target}.append({text})")
    out.append(f"    return _new(_Verdict, ({kind!r}, {name}, {rev}, allowed, cap, tuple(deciding), tuple(fired), "
               "tuple(messages), tuple(warnings), tuple(audits), (), None, None))")  # fmt: skip
    return out


def _place(rules: Sequence[Any], code: _Code, name: str, rev: str, default_tier: str) -> list[str]:
    """Body lines (inside the try) of a place evaluator: the first applying rule returns its placement."""
    out: list[str] = []
    dflt = code.const(default_tier or None)
    for r in rules:
        rn = code.const(r.name)
        cond = " and ".join([*(code.expr(m) for m in r.match), code.expr(r.when)])
        out.append(f"if {cond}:")
        tier = code.expr(r.tier_fn) if r.tier_fn is not None else code.const(r.tier)
        ttl = f"{code.expr(r.ttl_fn)}.total_seconds()" if r.ttl_fn is not None else code.const(r.ttl_s)
        prio = f"float({code.expr(r.priority_fn)})" if r.priority_fn is not None else code.const(r.priority)
        out += [f"    tier = {tier}", f"    ttl = {ttl}", f"    prio = {prio}", f"    fired.append({rn})"]
        if r.effect == "audit":
            out.append(f"    audits.append({rn} + ': would place in ' + str(tier) + ' (ttl ' + str(ttl) + "
                       "', priority ' + str(prio) + ')')")  # fmt: skip
        else:
            out.append(f"    return _new(_Verdict, ('place', {name}, {rev}, True, None, ({rn},), tuple(fired), (), (), "
                       f"tuple(audits), (), _new(_Placement, (tier or {dflt}, ttl, prio)), None))")  # fmt: skip
    out.append(f"return _new(_Verdict, ('place', {name}, {rev}, True, None, (), tuple(fired), (), (), "
               f"tuple(audits), (), _new(_Placement, ({dflt}, None, None)), None))")  # fmt: skip
    return out

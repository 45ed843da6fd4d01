"""Checking and code generation for CEL's extension macros and the optional-types syntax.

Two-variable comprehensions (`all(i, v, p)`, `exists`, `existsOne`, `transformList`, `transformMap`),
`cel.bind(x, init, expr)`, `optMap` / `optFlatMap`, optional selection and indexing (`a.?f`, `a[?k]`, and
plain selection or indexing on an optional) and optional list and map entries (`[?x]`, `{?k: x}`).
`check` types such a node for the `Checker`; `gen` writes its Python for the `Gen`; both return None for
nodes that are not theirs.
"""

from __future__ import annotations

from typing import Any

from nexuskv.cel.syntax.parser import Node
from nexuskv.cel.types import BOOL, DYN, INT, CelType, list_of, map_of, optional_of

Checker = Any  # the `checker.check.Checker` calling in (not imported: it imports this module)
Gen = Any  # the `codegen.generator.Gen` calling in

__all__ = ["check", "gen", "part_type"]


def _base(t: CelType) -> CelType:
    return t.elem if t.kind == "optional" else t


def check(ck: Checker, n: Node, scope: dict[str, CelType]) -> CelType | None:
    """The type of a macro or optional node (None when `n` is another kind of node)."""
    op = n.op
    if op.startswith("comp2:"):
        macro = op[6:]
        rt = ck.check(n.args[0], scope)
        if rt.kind == "list":
            kt, vt = INT, rt.elem
        elif rt.kind == "map":
            kt, vt = rt.key, rt.elem
        elif rt.kind == "dyn":
            kt, vt = DYN, DYN
        else:
            raise ck.error(n, f"{macro}() needs a list or a map, got {rt}")
        first, second = n.value
        inner = {**scope, first: kt, second: vt}
        if macro in ("all", "exists", "exists_one"):
            ck.want_bool(n.args[1], inner, f"predicate of {macro}()")
            return BOOL
        if len(n.args) == 3:
            ck.want_bool(n.args[1], inner, f"filter of {macro}()")
        body = ck.check(n.args[-1], inner)
        size = rt.max_size if rt.kind in ("list", "map") else None  # one item per item of the range, at most
        if macro == "transformList":
            return list_of(body, size)
        if macro == "transformMap":
            return map_of(kt if kt.kind != "dyn" else DYN, body, size)
        if body.kind not in ("map", "dyn"):
            raise ck.error(n, f"transformMapEntry() expression must give a map, got {body}")
        if body.kind == "dyn":
            return map_of(DYN, DYN)
        return body.with_size(None if size is None or body.max_size is None else size * body.max_size)
    if op == "bind":
        init = ck.check(n.args[0], scope)
        return ck.check(n.args[1], {**scope, n.value: init})
    if op in ("comp:optMap", "comp:optFlatMap"):
        ot = ck.check(n.args[0], scope)
        if ot.kind not in ("optional", "dyn"):
            raise ck.error(n, f"{op[5:]}() needs an optional, got {ot}")
        body = ck.check(n.args[1], {**scope, n.value: _base(ot) if ot.kind == "optional" else DYN})
        if op == "comp:optMap":
            return optional_of(body)
        if body.kind not in ("optional", "dyn"):
            raise ck.error(n, f"optFlatMap() expression must give an optional, got {body}")
        return body if body.kind == "optional" else optional_of(DYN)
    if op == "optselect":
        base = _base(ck.check(n.args[0], scope))
        if base.kind == "map":
            if base.key.kind not in ("string", "dyn"):
                raise ck.error(n, f"cannot select '{n.value}' on {base}: keys are not strings")
            return optional_of(base.elem)
        if base.kind == "message":
            fields = base.fields()
            if n.value not in fields:
                raise ck.error(n, f"unknown field '{n.value}' on {base}")
            return optional_of(fields[n.value].as_nullable(False))
        if base.kind == "dyn":
            return optional_of(DYN)
        raise ck.error(n, f"cannot select field '{n.value}' of a value of type {base}")
    if op == "optindex":
        base = _base(ck.check(n.args[0], scope))
        ck.check(n.args[1], scope)
        if base.kind in ("list", "map"):
            return optional_of(base.elem)
        if base.kind == "dyn":
            return optional_of(DYN)
        raise ck.error(n, f"cannot index a value of type {base}")
    if op == "opthas":
        ck.check(n.args[0], scope)
        return BOOL
    return None


def part_type(ck: Checker, n: Node, scope: dict[str, CelType]) -> CelType:
    """The type an element of a list or map literal contributes (`?x` contributes x's value type)."""
    if n.op != "optelem":
        return ck.check(n, scope)
    t = ck.check(n.args[0], scope)
    if t.kind not in ("optional", "dyn"):
        raise ck.error(n, f"?x in a literal needs an optional value, got {t}")
    n.t = t
    return t.elem if t.kind == "optional" else DYN


_GEN_OPS = frozenset({"bind", "comp:optMap", "comp:optFlatMap", "optselect", "optindex", "opthas"})


def gen(g: Gen, n: Node, scope: dict[str, str]) -> str | None:
    """Python for a macro or optional node (None when `n` is another kind of node)."""
    op = n.op
    if not op.startswith("comp2:") and op not in _GEN_OPS:
        return None
    pos = g.pos(n)
    if op.startswith("comp2:"):
        macro = op[6:]
        rng = f"_pairs({g.value(n.args[0], scope)}{pos})"
        var = f"_p{g.counter}"
        g.counter += 1
        first, second = n.value
        inner = {**scope, first: f"{var}[0]", second: f"{var}[1]"}
        if macro in ("all", "exists"):
            body = g.cond(n.args[1], inner)
            if g.exact:
                return f"_{macro}_x({rng}, lambda {var}: {body}{pos})"
            return f"{'all' if macro == 'all' else 'any'}({body} for {var} in {rng})"
        if macro == "exists_one":
            return f"(sum(1 for {var} in {rng} if {g.cond(n.args[1], inner)}) == 1)"
        where = f" if {g.cond(n.args[1], inner)}" if len(n.args) == 3 else ""
        body = g.g(n.args[-1], inner)
        if macro == "transformList":
            return f"[{body} for {var} in {rng}{where}]"
        if macro == "transformMap":
            return f"{{{var}[0]: {body} for {var} in {rng}{where}}}"
        return f"_mkmap([_e for {var} in {rng}{where} for _e in _entries({body}{pos})]{pos})"
    if op == "bind":  # the value is computed on first use: an unused failing value is no error
        var = f"_b{g.counter}"
        g.counter += 1
        body = g.g(n.args[1], {**scope, n.value: f"{var}()"})
        return f"(lambda {var}: {body})(_Lazy(lambda: {g.g(n.args[0], scope)}))"
    if op in ("comp:optMap", "comp:optFlatMap"):
        var = f"_o{g.counter}"
        g.counter += 1
        body = g.g(n.args[1], {**scope, n.value: var})
        fn = "_opt_map" if op == "comp:optMap" else "_opt_flat_map"
        return f"{fn}({g.g(n.args[0], scope)}, lambda {var}: {body}{pos})"
    if op == "optselect":
        return f"_opt_select({g.g(n.args[0], scope)}, {n.value!r}{pos})"
    if op == "optindex":
        return f"_opt_index({g.g(n.args[0], scope)}, {g.g(n.args[1], scope)}{pos})"
    if op == "opthas":
        return f"_opt_has({g.g(n.args[0], scope)}, {n.value!r}{pos})"
    return None

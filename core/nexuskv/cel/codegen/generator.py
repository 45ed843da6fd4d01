"""CEL code generation: a checked tree becomes one Python expression, fast or exact, over the runtime helpers.

The fast variant uses plain operators where the static types make them exact and short-circuits like Python;
the exact variant implements CEL's error-absorbing logic and records source positions for its errors.
Both run in the namespace `folding.runtime_globals` builds.
"""

from __future__ import annotations

import keyword
import math
from typing import Any

from nexuskv.cel.checker.check import CONVERSIONS, EQ_NATIVE, HASHABLE_IN, STRING_METHODS, native_conversion
from nexuskv.cel.checker.names import static_type_name
from nexuskv.cel.runtime import conversions
from nexuskv.cel.runtime import overloads as std
from nexuskv.cel.syntax import macros
from nexuskv.cel.syntax.parser import CelTypeError, Node
from nexuskv.cel.types import Env
from nexuskv.cel.values import TypeValue, Uint, uint_shape

# --------------------------------------------------------------------------------------------- codegen

_ARITH_HELPER = {
    ("int", "+"): "iadd", ("int", "-"): "isub", ("int", "*"): "imul", ("int", "/"): "idiv",
    ("int", "%"): "imod",
    ("uint", "+"): "uadd", ("uint", "-"): "usub", ("uint", "*"): "umul", ("uint", "/"): "udiv",
    ("uint", "%"): "umod",
}  # fmt: skip
_CONV_CODE: dict[tuple[str, str], str | None] = {
    ("int", "int"): None, ("int", "uint"): "int_of_uint", ("int", "double"): "int_of_double",
    ("int", "string"): "int_of_string", ("int", "timestamp"): "int_of_timestamp",
    ("uint", "int"): "uint_of_int", ("uint", "uint"): None, ("uint", "double"): "uint_of_double",
    ("uint", "string"): "uint_of_string",
    ("double", "int"): "float", ("double", "uint"): "float", ("double", "double"): None,
    ("double", "string"): "double_of_string",
    ("string", "string"): None, ("string", "int"): "str", ("string", "uint"): "str",
    ("string", "double"): "format_double", ("string", "bytes"): "string_of_bytes",
    ("string", "timestamp"): "string_of_timestamp", ("string", "duration"): "string_of_duration",
}  # fmt: skip


_READS = frozenset({"ident", "select", "index", "optselect", "optindex", "call"})
"""Nodes whose values come from outside the expression (activation, plugins, containers)."""


def attribute(obj: str, field: str) -> str:
    """Python reading field `field` of `obj`: `obj.field` for a plain name, else `getattr` with the name quoted."""
    if field.isidentifier() and not keyword.iskeyword(field) and not field.startswith("__"):
        return f"{obj}.{field}"
    return f"getattr({obj}, {field!r})"


def _same_key_kind(key: str, declared: str) -> bool:
    """Whether a Python dict lookup finds exactly what CEL's does: one non-dyn kind (bool keys never meet ints)."""
    return key == declared and key not in ("dyn", "double")


class Gen:
    """Generates one Python expression for a checked tree: `exact=False` is the fast variant."""

    def __init__(
        self, env: Env, exact: bool, consts: dict[str, Any], positions: list[tuple[int, int]]
    ) -> None:
        self.env = env
        self.exact = exact
        self.consts = consts
        self.positions = positions
        self.hoisted: dict[str, str] = {}
        self.counter = 0

    def const(self, value: Any) -> str:
        for name, v in self.consts.items():
            if v is value:
                return name
        name = f"_k{len(self.consts)}"
        self.consts[name] = value
        return name

    def pos(self, n: Node) -> str:
        if not self.exact:
            return ""
        self.positions.append((n.line, n.col))
        return f", {len(self.positions) - 1}"

    def lit(self, v: Any) -> str:
        if v is None or isinstance(v, bool):
            return repr(v)
        if isinstance(v, int) and not isinstance(v, Uint):
            return f"({v})" if v < 0 else repr(v)
        if isinstance(v, float):
            return f"({v!r})" if math.isfinite(v) else self.const(v)
        if isinstance(v, str | bytes):
            return repr(v)
        return self.const(v)

    def value(self, n: Node, scope: dict[str, str], silent: bool = False) -> str:
        """Code for an operand that must not be null; `silent` where Python would not raise on None."""
        code = self.g(n, scope)
        if n.t.nullable and (self.exact or silent):
            return f"_nn({code}{self.pos(n)})"
        return code

    def cond(self, n: Node, scope: dict[str, str]) -> str:
        code = self.value(n, scope, silent=True)
        if n.t.kind == "dyn":
            return f"_as_bool({code}{self.pos(n)})"
        return code

    def g(self, n: Node, scope: dict[str, str]) -> str:
        code = self._g(n, scope)
        if n.op in _READS:
            shape = uint_shape(n.t)  # a uint read from outside may be a plain int: tag it for dyn dispatch
            if shape == "u":
                return f"_as_uint({code})"
            if shape is not None:
                return f"_uint_deep({code}, {self.const(shape)})"
        return code

    def _g(self, n: Node, scope: dict[str, str]) -> str:
        op = n.op
        if op == "lit":
            return self.lit(n.value)
        if op == "raise":
            return f"_fail({n.value!r}{self.pos(n)})"
        code = macros.gen(self, n, scope)
        if code is not None:
            return code
        if op == "ident":
            name = n.value
            if name in scope and not n.method:
                return scope[name]
            if self.exact:
                return f"_var(A, {name!r}{self.pos(n)})"
            if name not in self.hoisted:
                self.hoisted[name] = f"_v{len(self.hoisted)}"
            return self.hoisted[name]
        if op == "select":
            return self.select(n, scope)
        if op == "has":
            obj = n.args[0]
            field = n.value
            if obj.t.kind == "message":
                if self.exact:
                    return f"(_sel({self.g(obj, scope)}, {field!r}{self.pos(n)}) is not None)"
                return f"({attribute(self.g(obj, scope), field)} is not None)"
            if obj.t.kind == "map":
                return f"({field!r} in {self.value(obj, scope)})"
            return f"_d_has({self.g(obj, scope)}, {field!r}{self.pos(n)})"
        if op == "index":
            obj, idx = n.args
            o, i = self.value(obj, scope), self.value(idx, scope, silent=True)
            if obj.t.kind == "list" and idx.t.kind != "dyn":
                return f"_lidx({o}, {i}{self.pos(n)})"
            if obj.t.kind == "map" and _same_key_kind(idx.t.kind, obj.t.key.kind):
                return f"_mget({o}, {i}{self.pos(n)})" if self.exact else f"{o}[{i}]"
            return f"_d_index({o}, {i}{self.pos(n)})"  # CEL's key equality: true is not 1
        if op == "list":
            return "[" + ", ".join(self.element(a, scope) for a in n.args) + "]"
        if op == "map":
            keys = n.args[0::2]
            if any(v.op == "optelem" for v in n.args[1::2]):
                entries = ", ".join(
                    f"*_opt_entry({self.value(k, scope, silent=True)}, {self.g(v.args[0], scope)}{self.pos(v)})"
                    if v.op == "optelem" else f"({self.value(k, scope, silent=True)}, {self.g(v, scope)})"
                    for k, v in zip(keys, n.args[1::2], strict=True)
                )  # fmt: skip
                return f"_mkmap(({entries},){self.pos(n)})"
            if (
                all(k.op == "lit" and isinstance(k.value, str | int) for k in keys)
                and len({k.value for k in keys}) == len(keys)
            ):
                pairs = (
                    f"{self.g(k, scope)}: {self.g(v, scope)}" for k, v in zip(keys, n.args[1::2], strict=True)
                )
                return "{" + ", ".join(pairs) + "}"
            items = ", ".join(
                f"({self.value(k, scope, silent=True)}, {self.g(v, scope)})"
                for k, v in zip(keys, n.args[1::2], strict=True)
            )
            return f"_mkmap(({items},){self.pos(n)})"
        if op == "!":
            return f"(not {self.cond(n.args[0], scope)})"
        if op == "neg":
            a = n.args[0]
            if a.t.kind == "int":
                return f"_ineg({self.value(a, scope)}{self.pos(n)})"
            if a.t.kind == "double":
                return f"(-{self.value(a, scope)})"
            return f"_d_neg({self.g(a, scope)}{self.pos(n)})"
        if op in ("&&", "||"):
            parts = self.flatten(n, op)
            if self.exact:
                fn = "_and_" if op == "&&" else "_or_"
                thunks = "".join(f"lambda: {self.cond(p, scope)}, " for p in parts)
                return f"{fn}(({thunks}){self.pos(n)})"
            word = " and " if op == "&&" else " or "
            return "(" + word.join(self.cond(p, scope) for p in parts) + ")"
        if op == "?:":
            c, a, b = n.args
            return f"({self.g(a, scope)} if {self.cond(c, scope)} else {self.g(b, scope)})"
        if op in ("+", "-", "*", "/", "%"):
            return self.arith(n, scope)
        if op in ("==", "!="):
            return self.equality(n, scope)
        if op in ("<", "<=", ">", ">="):
            a, b = n.args
            if a.t.kind == "dyn" or b.t.kind == "dyn" or (a.t.kind != b.t.kind and "double" in (a.t.kind, b.t.kind)):
                return f"_d_cmp({op!r}, {self.g(a, scope)}, {self.g(b, scope)}{self.pos(n)})"
            return f"({self.value(a, scope)} {op} {self.value(b, scope)})"
        if op == "in":
            return self.contains(n, scope)
        if op.startswith("comp:"):
            return self.comprehension(n, scope)
        if op == "call":
            return self.call(n, scope)
        raise AssertionError(op)  # pragma: no cover

    def element(self, n: Node, scope: dict[str, str]) -> str:
        """A list literal's element: `?x` adds x's value only when it has one."""
        if n.op == "optelem":
            return f"*_opt_items({self.g(n.args[0], scope)}{self.pos(n)})"
        return self.g(n, scope)

    @staticmethod
    def flatten(n: Node, op: str) -> list[Node]:
        """The operands of a chain `a && b && c` (left-nested in the tree), without recursion."""
        out: list[Node] = []
        stack = [n]
        while stack:
            cur = stack.pop()
            if cur.op == op:
                stack.extend(reversed(cur.args))
            else:
                out.append(cur)
        return out

    def select(self, n: Node, scope: dict[str, str]) -> str:
        obj = n.args[0]
        field = n.value
        kind = obj.t.kind
        if kind == "message":
            if self.exact:
                return f"_sel({self.g(obj, scope)}, {field!r}{self.pos(n)})"
            return attribute(self.g(obj, scope), field)
        if kind == "map":
            o = self.value(obj, scope)
            return f"_mget({o}, {field!r}{self.pos(n)})" if self.exact else f"{o}[{field!r}]"
        return f"_d_select({self.g(obj, scope)}, {field!r}{self.pos(n)})"

    def arith(self, n: Node, scope: dict[str, str]) -> str:
        op = n.op
        a, b = n.args
        ka, kb = a.t.kind, b.t.kind
        if "dyn" in (ka, kb):
            return f"_d_arith({op!r}, {self.g(a, scope)}, {self.g(b, scope)}{self.pos(n)})"
        x, y = self.value(a, scope), self.value(b, scope)
        helper = _ARITH_HELPER.get((ka, op))
        if helper is not None:
            return f"_{helper}({x}, {y}{self.pos(n)})"
        if ka == "double":
            if op == "/":
                return f"_fdiv({x}, {y}{self.pos(n)})"
            return f"({x} {op} {y})"
        if ka in ("string", "bytes"):
            return f"({x} + {y})"
        if ka == "list":
            return f"[*{x}, *{y}]"
        return f"_t{'add' if op == '+' else 'sub'}({x}, {y}{self.pos(n)})"

    def equality(self, n: Node, scope: dict[str, str]) -> str:
        a, b = n.args
        neg = n.op == "!="
        if (b.t.kind == "null" and a.t.kind != "dyn") or (a.t.kind == "null" and b.t.kind != "dyn"):
            other = a if b.t.kind == "null" else b
            return f"({self.g(other, scope)} is {'not ' if neg else ''}None)"
        x, y = self.g(a, scope), self.g(b, scope)
        if a.t.kind in EQ_NATIVE and b.t.kind in EQ_NATIVE:
            return f"({x} {n.op} {y})"
        return f"({'not ' if neg else ''}_eq({x}, {y}))"

    def contains(self, n: Node, scope: dict[str, str]) -> str:
        a, b = n.args
        x = self.g(a, scope)
        if b.t.kind == "map" and _same_key_kind(a.t.kind, b.t.key.kind):
            return f"({x} in {self.value(b, scope)})"
        if b.t.kind == "list":
            elem = b.t.elem.kind
            native = elem in HASHABLE_IN and a.t.kind in HASHABLE_IN
            if native and b.op == "list" and all(i.op == "lit" for i in b.args):
                values = [i.value for i in b.args]
                return f"({x} in {self.const(frozenset(values))})"
            if native:
                return f"({x} in {self.value(b, scope)})"
            return f"_in_list({x}, {self.value(b, scope)})"
        return f"_d_in({x}, {self.g(b, scope)}{self.pos(n)})"

    def comprehension(self, n: Node, scope: dict[str, str]) -> str:
        macro = n.op[5:]
        rng = n.args[0]
        r = self.value(rng, scope)
        if rng.t.kind == "dyn":
            r = f"_d_iter({r}{self.pos(n)})"
        var = f"_i{self.counter}"
        self.counter += 1
        inner = {**scope, n.value: var}
        if macro in ("all", "exists"):
            body = self.cond(n.args[1], inner)
            if self.exact:
                return f"_{macro}_x({r}, lambda {var}: {body}{self.pos(n)})"
            fn = "all" if macro == "all" else "any"
            return f"{fn}({body} for {var} in {r})"
        if macro == "exists_one":
            body = self.cond(n.args[1], inner)
            return f"(sum(1 for {var} in {r} if {body}) == 1)"
        if macro == "filter":
            return f"[{var} for {var} in {r} if {self.cond(n.args[1], inner)}]"
        if len(n.args) == 3:
            return f"[{self.g(n.args[2], inner)} for {var} in {r} if {self.cond(n.args[1], inner)}]"
        return f"[{self.g(n.args[1], inner)} for {var} in {r}]"

    def call(self, n: Node, scope: dict[str, str]) -> str:
        name = n.value
        decl = self.env.functions.get(name)
        if decl is not None:
            fn = self.const(decl.impl)
            args = ", ".join(self.value(a, scope, silent=True) for a in n.args)
            if self.exact:
                return f"_call_plugin({fn}, {name!r}{self.pos(n)}, {args})"
            return f"{fn}({args})"
        args = n.args
        if name == "size":
            a = args[0]
            if a.t.kind == "dyn":
                return f"_d_size({self.g(a, scope)}{self.pos(n)})"
            return f"len({self.value(a, scope)})"
        if name in STRING_METHODS:
            recv, arg = args
            s = self.strval(recv, scope)
            if name == "matches":
                if arg.op == "lit":
                    try:
                        rx = conversions.compile_regex(arg.value)
                    except conversions.RegexError as exc:
                        raise CelTypeError(f"invalid regular expression {arg.value!r} in matches(): "
                                           f"{conversions.regex_problem(exc)}", arg.line, arg.col) from None
                    return f"({self.const(rx)}.search({s}) is not None)"
                return f"_matches({s}, {self.strval(arg, scope)}{self.pos(n)})"
            p = self.strval(arg, scope)
            if name == "contains":
                return f"({p} in {s})"
            return f"{s}.{'startswith' if name == 'startsWith' else 'endswith'}({p})"
        if n.method or len(args) != 1 or not native_conversion(name, args[0].t.kind):
            return self.std(n, scope)
        a = args[0]
        src = a.t.kind
        if name in CONVERSIONS:
            x = self.value(a, scope, silent=True)  # str(None), identity conversions would not raise
            if (name, src) == ("string", "bool"):
                return f"('true' if {x} else 'false')"
            helper = _CONV_CODE[(name, src)]
            if helper is None:
                return x
            if helper in ("float", "str"):
                return f"{helper}({x})"
            return f"_{helper}({x}{self.pos(n)})"
        if name == "bytes_of":
            return f"_bytes_of({self.value(a, scope, silent=True)}{self.pos(n)})"
        if name in ("duration", "timestamp"):
            return f"_{name}({self.strval(a, scope)}{self.pos(n)})"
        raise AssertionError(name)  # pragma: no cover

    def std(self, n: Node, scope: dict[str, str]) -> str:
        """A call of a standard function or extension: direct when one overload fits exactly, else dispatched."""
        name = n.value
        if name == "dyn":
            a = n.args[0]
            return f"_as_uint({self.g(a, scope)})" if a.t.kind == "uint" else self.g(a, scope)
        if name == "type":
            static = static_type_name(n.args[0].t)
            if static is not None:  # the argument is still evaluated: type() of an error is that error
                return f"({self.g(n.args[0], scope)}, {self.const(TypeValue(static))})[1]"
            return f"_type_value({self.g(n.args[0], scope)})"
        found, exact = std.candidates(name, n.method, [a.t for a in n.args])
        count = len(n.args)
        args = "".join(
            f", {self.g(a, scope)}"  # null is a value where the parameter is dyn (optional.of(x.unset))
            if a.t.nullable and any(ov.kinds(count)[i] == "dyn" for ov in found)
            else f", {self.value(a, scope, silent=True)}"
            for i, a in enumerate(n.args)
        )
        if exact:
            fn = self.const(found[0].impl)
            if self.exact:
                return f"_call_plugin({fn}, {name!r}{self.pos(n)}{args})"
            return f"{fn}({args[2:]})"
        pos = self.pos(n)[2:] or "-1"
        return f"_dispatch({name!r}, {n.method}, {pos}{args})"

    def strval(self, n: Node, scope: dict[str, str]) -> str:
        if n.t.kind == "dyn":
            return f"_d_str({self.g(n, scope)}{self.pos(n)})"
        return self.value(n, scope)

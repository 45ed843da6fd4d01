"""The CEL type checker and the static cost bound.

`Checker.check` types every node of a parsed tree against an `Env` (variables, message types, plugin
functions), rejecting unknown names (with a did-you-mean), wrong operand types and results of the wrong type;
`cost_of` is the static upper bound the cost limit is checked against (the model is in `cel`'s docstring).
"""

from __future__ import annotations

from nexuskv.cel.checker import generics as generic
from nexuskv.cel.checker import names as resolve
from nexuskv.cel.checker import sizes
from nexuskv.cel.checker.relations import FREE, compat, nullable_eq, slen, sum_size
from nexuskv.cel.checker.relations import join as _join
from nexuskv.cel.runtime import overloads as std
from nexuskv.cel.runtime.core import NUMERIC
from nexuskv.cel.syntax import macros
from nexuskv.cel.syntax.parser import CelTypeError, Node
from nexuskv.cel.types import (
    BOOL,
    DOUBLE,
    DURATION,
    DYN,
    INT,
    STRING,
    TIMESTAMP,
    UINT,
    CelType,
    Env,
    FunctionDecl,
    list_of,
    map_of,
)
from nexuskv.errors import did_you_mean

# --------------------------------------------------------------------------------------------- checker

_ORDERED = {"int", "uint", "double", "string", "bytes", "bool", "timestamp", "duration"}
EQ_NATIVE = {"int", "uint", "double", "string", "bytes", "bool", "timestamp", "duration"}
HASHABLE_IN = {"int", "uint", "string", "bytes", "bool", "timestamp", "duration"}
CONVERSIONS: dict[str, set[str]] = {
    "int": {"int", "uint", "double", "string", "timestamp"},
    "uint": {"int", "uint", "double", "string"},
    "double": {"int", "uint", "double", "string"},
    "string": {"int", "uint", "double", "string", "bytes", "bool", "timestamp", "duration"},
}
_CONVERSION_RESULT = {"int": INT, "uint": UINT, "double": DOUBLE, "string": STRING}
_STRING_SIZE = {"int": 20, "uint": 20, "double": 32, "bool": 5, "timestamp": 40, "duration": 40}
STRING_METHODS = {"startsWith", "endsWith", "contains", "matches"}
FOLDABLE = {
    "!", "neg", "+", "-", "*", "/", "%", "==", "!=", "<", "<=", ">", ">=", "?:", "&&", "||", "call",
}  # fmt: skip
FOLD_AT_COMPILE = {"bytes_of", "duration", "timestamp"}


class Checker:
    """Type-checks a tree against an Env, annotating every node with its type."""

    def __init__(self, env: Env, source: str, container: str = "", checked: bool = True) -> None:
        self.env = env
        self.source = source
        self.container = container
        self.checked = checked

    def error(self, n: Node, message: str) -> CelTypeError:
        return CelTypeError(message, n.line, n.col, self.source)

    def declared(self, name: str) -> bool:
        return name in self.env.variables

    def check(self, n: Node, scope: dict[str, CelType]) -> CelType:
        if self.checked:
            t = self._check(n, scope)
        else:  # parse-only mode: what the checker would reject fails at run time instead
            try:
                t = self._check(n, scope)
            except CelTypeError as exc:
                n.op, n.args, n.value, t = "raise", [], exc.message, DYN
        n.t = t
        return t

    def _check(self, n: Node, scope: dict[str, CelType]) -> CelType:
        op = n.op
        if op == "lit":
            return n.t if self.checked or n.t.kind == "type" else DYN
        if op == "raise":
            return DYN
        mt = macros.check(self, n, scope)
        if mt is not None:
            return mt
        if op == "ident":
            name = n.value
            if name.startswith("."):  # absolute name: no comprehension variable, no container
                name, n.method = name[1:], True
            elif name in scope and not n.method:
                return scope[name]
            for full in [name] if n.method else resolve.candidates(name, self.container):
                if full in self.env.variables:
                    n.value = full
                    return self.env.variables[full]
            if name in resolve.TYPE_NAMES:
                resolve.to_type_literal(n, name)
                return n.t
            if not self.checked:
                return DYN
            raise self.error(
                n, f"undeclared variable '{name}'{did_you_mean(name, [*scope, *self.env.variables])}"
            )
        if op == "select" and resolve.qualify(n, scope, self.declared, self.container):
            return self._check(n, scope)
        if op in ("select", "has"):
            ot = self.check(n.args[0], scope)
            field = n.value
            if ot.kind == "optional":  # selection on an optional is optional selection
                n.op = "optselect" if op == "select" else "opthas"
                return macros.check(self, n, scope)  # type: ignore[return-value]
            if ot.kind == "message":
                fields = ot.fields()
                if field not in fields:
                    raise self.error(n, f"unknown field '{field}' on {ot}{did_you_mean(field, fields)}")
                return BOOL if op == "has" else fields[field]
            if ot.kind == "map":
                if ot.key.kind not in ("string", "dyn"):
                    raise self.error(n, f"cannot select '{field}' on {ot}: keys are not strings")
                return BOOL if op == "has" else ot.elem
            if ot.kind == "dyn":
                return BOOL if op == "has" else DYN
            what = "has() on" if op == "has" else "cannot select field"
            raise self.error(
                n, f"{what} '{field}' of a value of type {ot} (only messages and maps have fields)"
            )
        if op == "index":
            ot = self.check(n.args[0], scope)
            it = self.check(n.args[1], scope)
            if ot.kind == "optional":
                n.op = "optindex"
                return macros.check(self, n, scope)  # type: ignore[return-value]
            if ot.kind == "list":
                if it.kind not in ("int", "uint", "dyn"):
                    raise self.error(n, f"list index must be int, got {it}")
                return ot.elem
            if ot.kind == "map":
                if not compat(it, ot.key):
                    raise self.error(n, f"map key must be {ot.key}, got {it}")
                return ot.elem
            if ot.kind == "dyn":
                return DYN
            raise self.error(n, f"cannot index a value of type {ot}")
        if op == "list":
            if not n.args:
                return list_of(FREE, 0)
            elem = macros.part_type(self, n.args[0], scope)
            for a in n.args[1:]:
                at = macros.part_type(self, a, scope)
                joined = _join(elem, at)
                elem = DYN if joined is None else joined  # mixed elements: list(dyn)
            return list_of(elem, len(n.args))
        if op == "map":
            if not n.args:
                return map_of(FREE, FREE, 0)
            kt: CelType | None = None
            vt: CelType | None = None
            for i in range(0, len(n.args), 2):
                k, v = n.args[i], n.args[i + 1]
                ct, cv = self.check(k, scope), macros.part_type(self, v, scope)
                if ct.kind not in ("int", "uint", "bool", "string", "dyn"):
                    raise self.error(k, f"map keys must be int, uint, bool or string, not {ct}")
                nk = ct if kt is None else _join(kt, ct)
                nv = cv if vt is None else _join(vt, cv)
                kt = DYN if nk is None else nk.as_nullable(False)  # mixed: dyn
                vt = DYN if nv is None else nv
            assert kt is not None and vt is not None
            return map_of(kt, vt, len(n.args) // 2)
        if op == "!":
            self.want_bool(n.args[0], scope, "operand of '!'")
            return BOOL
        if op == "neg":
            t = self.check(n.args[0], scope)
            if t.kind in ("int", "double", "dyn"):
                return t.as_nullable(False).with_size(None)
            raise self.error(n, f"unary '-' is not defined for {t}")
        if op in ("&&", "||"):
            for a in n.args:
                self.want_bool(a, scope, f"operand of '{op}'")
            return BOOL
        if op == "?:":
            self.want_bool(n.args[0], scope, "condition of '?:'")
            a, b = self.check(n.args[1], scope), self.check(n.args[2], scope)
            joined = _join(a, b)
            if joined is None:
                raise self.error(n, f"branches of '?:' have different types: {a} and {b}")
            return joined
        if op in ("+", "-", "*", "/", "%"):
            return self.arith(n, scope)
        if op in ("==", "!="):
            a, b = self.check(n.args[0], scope), self.check(n.args[1], scope)
            if not (compat(a, b) or nullable_eq(a, b)):
                raise self.error(n, f"cannot compare {a} {op} {b} (operands must have the same type)")
            return BOOL
        if op in ("<", "<=", ">", ">="):
            a, b = self.check(n.args[0], scope), self.check(n.args[1], scope)
            ok = (a.kind == b.kind and a.kind in _ORDERED) or (
                "dyn" in (a.kind, b.kind) and {a.kind, b.kind} <= (_ORDERED | {"dyn"})
            ) or {a.kind, b.kind} <= NUMERIC  # numbers compare across int, uint and double
            if not ok:
                raise self.error(n, f"operator '{op}' is not defined for {a} and {b}")
            return BOOL
        if op == "in":
            a, b = self.check(n.args[0], scope), self.check(n.args[1], scope)
            if b.kind == "list":
                if not (compat(a, b.elem) or nullable_eq(a, b.elem)):
                    raise self.error(n, f"'in': cannot look for {a} in {b}")
            elif b.kind == "map":
                if not compat(a, b.key):
                    raise self.error(n, f"'in': cannot look for {a} among the keys of {b}")
            elif b.kind != "dyn":
                raise self.error(n, f"'in' needs a list or a map on the right, got {b}")
            return BOOL
        if op.startswith("comp:"):
            return self.comprehension(n, scope)
        if op == "call":
            return self.call(n, scope)
        raise self.error(n, f"unsupported expression {op!r}")  # pragma: no cover

    def want_bool(self, n: Node, scope: dict[str, CelType], what: str) -> None:
        t = self.check(n, scope)
        if t.kind not in ("bool", "dyn"):
            raise self.error(n, f"{what} must be bool, got {t}")

    def arith(self, n: Node, scope: dict[str, CelType]) -> CelType:
        op = n.op
        a, b = self.check(n.args[0], scope), self.check(n.args[1], scope)
        ka, kb = a.kind, b.kind
        if "dyn" in (ka, kb):
            other = kb if ka == "dyn" else ka
            if (
                other in NUMERIC | {"dyn"}
                or (op in "+-" and other in {"timestamp", "duration"})
                or (op == "+" and other in {"string", "bytes", "list"})
            ):
                return DYN
        elif ka == kb:
            if ka in NUMERIC and not (ka == "double" and op == "%"):
                return CelType(ka)
            if op == "+" and ka in ("string", "bytes"):
                return CelType(ka, max_size=sum_size(a, b))
            if op == "+" and ka == "list":
                joined = _join(a.elem, b.elem)
                if joined is not None:
                    return list_of(joined, sum_size(a, b))
            if ka == "duration" and op in "+-":
                return DURATION
            if ka == "timestamp" and op == "-":
                return DURATION
        elif {ka, kb} == {"timestamp", "duration"} and (op == "+" or (op == "-" and ka == "timestamp")):
            return TIMESTAMP
        hint = ""
        if {ka, kb} <= NUMERIC:
            hint = f" (no implicit conversion: use {kb}() or {ka}())"
        raise self.error(n, f"operator '{op}' is not defined for {a} and {b}{hint}")

    def comprehension(self, n: Node, scope: dict[str, CelType]) -> CelType:
        macro = n.op[5:]
        rt_ = self.check(n.args[0], scope)
        if rt_.kind == "list":
            vt = rt_.elem
        elif rt_.kind == "map":
            vt = rt_.key
        elif rt_.kind == "dyn":
            vt = DYN
        else:
            raise self.error(n, f"{macro}() needs a list or a map, got {rt_}")
        inner = {**scope, n.value: vt}
        size = rt_.max_size if rt_.kind in ("list", "map") else None
        if macro == "map":
            if len(n.args) == 3:
                body = self.check(n.args[2], inner)
                self.want_bool(n.args[1], inner, "filter of map()")
            else:
                body = self.check(n.args[1], inner)
            return list_of(body, size)
        self.want_bool(n.args[1], inner, f"predicate of {macro}()")
        if macro == "filter":
            return list_of(vt, size)
        return BOOL

    def call(self, n: Node, scope: dict[str, CelType]) -> CelType:
        if not resolve.namespaced_call(n, scope, self.declared, lambda name: std.is_function(name, False)):
            ns = resolve.namespace_of(n, scope, self.declared)
            if ns is not None and any(k.startswith(ns + ".") for k in std.FUNCTIONS):
                name = f"{ns}.{n.value}"
                raise self.error(n, f"unknown function '{name}'{did_you_mean(name, std.FUNCTIONS)}")
        name = n.value
        args = [self.check(a, scope) for a in n.args]
        decl = self.env.functions.get(name)
        if decl is not None:
            return self.plugin(n, decl, args)
        if name == "size":
            if len(args) != 1:
                raise self.error(n, "size() takes one argument: size(x) or x.size()")
            if args[0].kind not in ("string", "bytes", "list", "map", "dyn"):
                raise self.error(n, f"size() is not defined for {args[0]}")
            return INT
        if name in STRING_METHODS:
            if not n.method and name != "matches":  # the spec has matches(string, string) as a function too
                raise self.error(n, f"{name}() is a method: use s.{name}(...)")
            if len(args) != 2:
                raise self.error(n, f"{name}() takes one argument")
            for a, t in zip(n.args, args, strict=True):
                if t.kind not in ("string", "dyn"):
                    raise self.error(a, f"{name}() is defined on strings, got {t}")
            return BOOL
        if not n.method and len(args) == 1 and native_conversion(name, args[0].kind):
            src = args[0].kind
            if name in CONVERSIONS:
                result = _CONVERSION_RESULT[name]
                if name == "string":
                    size = slen(args[0]) if src in ("string", "bytes") else _STRING_SIZE.get(src)
                    return result.with_size(size)
                return result
            if name == "bytes_of":
                return INT
            return DURATION if name == "duration" else TIMESTAMP
        found, _ = std.candidates(name, n.method, args)
        if found and name in ("orValue", "or") and args[0].kind == "optional":  # optional(T).orValue(T) -> T
            want = args[0].elem if name == "orValue" else args[0]
            joined = _join(want, args[1]) if compat(args[1], want) else None
            if joined is None:
                raise self.error(n, f"no matching overload for {args[0]}.{name}({args[1]})")
            return joined
        if found:  # a builder's result carries the size bound its arguments allow
            return sizes.call_bound(name, n.args, std.result_of(found, args))
        shown = ", ".join(map(str, args[1:] if n.method else args))
        if std.is_function(name, n.method) or name == "bytes_of":
            where = f"{args[0]}.{name}" if n.method else name
            raise self.error(n, f"no matching overload for {where}({shown})")
        if n.method:
            if std.is_function(name, False):
                raise self.error(n, f"{name}() is a function: use {name}(x)")
            methods = [*_BUILTIN_METHODS, *(k for k in std.FUNCTIONS if std.is_function(k, True))]
            methods += [d.name for d in self.env.functions.values() if getattr(d, "receiver", False)]
            raise self.error(n, f"unknown method '{name}' on {args[0]}{did_you_mean(name, methods)}")
        if std.is_function(name, True):
            raise self.error(n, f"{name}() is a method: use x.{name}(...)")
        known = [*self.env.functions, "size", "bytes_of", *(k for k in std.FUNCTIONS if std.is_function(k, False))]
        raise self.error(n, f"unknown function '{name}'{did_you_mean(name, known)}")

    def plugin(self, n: Node, decl: FunctionDecl, args: list[CelType]) -> CelType:
        style = f"x.{decl.name}(...)" if decl.receiver else f"{decl.name}(...)"
        if n.method != decl.receiver:
            raise self.error(n, f"{decl.name}() must be called as {style}")
        if len(args) != len(decl.args):
            raise self.error(n, f"{decl.name}() takes {len(decl.args)} arguments, got {len(args)}")
        bindings: dict[str, CelType] = {}
        for i, (a, want) in enumerate(zip(args, decl.args, strict=True)):
            if not generic.unify(want, a, bindings, _join, compat):
                raise self.error(n.args[i], f"argument {i + 1} of {decl.name}() must be {want}, got {a}")
        return generic.substitute(decl.result, bindings) if bindings else decl.result


def native_conversion(name: str, src: str) -> bool:
    """Whether the conversion `name(src)` has a dedicated code path (others go through the overload table)."""
    if name in CONVERSIONS:
        return src in CONVERSIONS[name]  # a dyn argument is dispatched by the overload table at run time
    if name == "bytes_of":
        return src in ("string", "int", "dyn")
    return name in ("duration", "timestamp") and src == "string"


_BUILTIN_METHODS = ("contains", "startsWith", "endsWith", "matches", "size", "all", "exists", "exists_one", "map",
                    "filter")  # fmt: skip
"""Methods (and macros) the checker handles before the overload table: offered as did-you-mean too."""

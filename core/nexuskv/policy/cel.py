"""The CEL pipeline of the policy engine: parse (cel-python's grammar), type-check, bound the cost, compile.

`compile_expr` turns an expression into a `Compiled` callable that evaluates over native Python values. The
checked tree is translated to one Python expression (plain operators where the static types make them exact,
helpers from `_celrt` where CEL semantics need them) and compiled once. `&&`, `||`, `all` and `exists` run as
Python's short-circuit operators; when that fast code raises, the expression is re-evaluated by an exact
variant that implements CEL's error-absorbing logic, so both agree wherever the fast code succeeds.

Cost model (a static upper bound, like Kubernetes CEL): every node costs 1; string and bytes comparisons,
concatenation, `contains`, `startsWith` (the prefix), `endsWith`, `matches` (text and pattern) and string
conversions add 0.1 per character of the declared maximum length; `in` on a list and list / map equality
add the maximum number of items; a comprehension costs its range plus (maximum items) x (body + 1).
"""

from __future__ import annotations

import builtins
import difflib
import io
import math
import re
import tokenize
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import celpy.celparser
import lark
from celpy.celparser import CELParser
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from nexuskv.policy import _celrt as rt
from nexuskv.policy._celrt import CelEvalError
from nexuskv.policy.types import (
    BOOL,
    BYTES,
    DEFAULT_MAX_LIST,
    DEFAULT_MAX_STRING,
    DOUBLE,
    DURATION,
    DYN,
    INT,
    NULL,
    STRING,
    TIMESTAMP,
    UINT,
    CelType,
    Env,
    FunctionDecl,
    list_of,
    map_of,
)

__all__ = [
    "CelCostError",
    "CelError",
    "CelEvalError",
    "CelSyntaxError",
    "CelTypeError",
    "Compiled",
    "compile_expr",
    "fuse",
    "subexpressions",
]


# --------------------------------------------------------------------------------------------- errors


class CelError(Exception):
    """A compile-time error in a CEL expression; `line`, `column` are 1-based, `source` is the expression."""

    def __init__(
        self, message: str, line: int | None = None, column: int | None = None, source: str | None = None
    ) -> None:
        """Create the error."""
        super().__init__(message)
        self.message = message
        self.line = line
        self.column = column
        self.source = source

    def __str__(self) -> str:
        """`line:column: message`, followed by the source line and a caret under the column."""
        if self.line is None:
            return self.message
        text = f"{self.line}:{self.column}: {self.message}"
        if self.source is not None and self.column is not None:
            lines = self.source.splitlines() or [""]
            if 0 < self.line <= len(lines):
                text += f"\n  | {lines[self.line - 1]}\n  | {' ' * (self.column - 1)}^"
        return text


class CelSyntaxError(CelError):
    """The expression does not parse, or uses syntax the policy engine does not support."""


class CelTypeError(CelError):
    """Unknown variable, field or function, operands of the wrong type, or a result of the wrong type."""


class CelCostError(CelError):
    """The static cost bound of the expression exceeds the limit."""


# --------------------------------------------------------------------------------------------- tree


class _Node:
    """One node of the checked expression tree."""

    __slots__ = ("args", "col", "line", "method", "op", "t", "value")

    def __init__(
        self, op: str, args: list[_Node], line: int, col: int, value: Any = None, method: bool = False
    ) -> None:
        self.op = op
        self.args = args
        self.line = line
        self.col = col
        self.value = value
        self.method = method
        self.t: CelType = DYN


_COMPREHENSIONS = {"all", "exists", "exists_one", "map", "filter"}
_BINARY = {
    "relation_lt": "<", "relation_le": "<=", "relation_gt": ">", "relation_ge": ">=",
    "relation_eq": "==", "relation_ne": "!=", "relation_in": "in",
    "addition_add": "+", "addition_sub": "-",
    "multiplication_mul": "*", "multiplication_div": "/", "multiplication_mod": "%",
}  # fmt: skip
_ESCAPE = re.compile(
    r"\\(?:([abfnrtv\"'\\`?])|[xX]([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})"
    r"|([0-3][0-7]{2})|(.|\n)?)"
)
_SIMPLE_ESCAPES = {
    "a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
    '"': '"', "'": "'", "\\": "\\", "`": "`", "?": "?",
}  # fmt: skip

_RESERVED = frozenset({
    "as", "break", "const", "continue", "else", "for", "function", "if", "import", "let", "loop", "package",
    "namespace", "return", "var", "void", "while",
})  # fmt: skip
_PARSER: lark.Lark | None = None


def _lark() -> lark.Lark:
    """Our own instance of cel-python's grammar (its shared parser may build other tree classes)."""
    global _PARSER
    if _PARSER is None:
        grammar = (Path(celpy.celparser.__file__).parent / "cel.lark").read_text()
        _PARSER = lark.Lark(
            grammar,
            parser="lalr",
            start="expr",
            g_regex_flags=re.M,
            lexer_callbacks={"IDENT": CELParser.ambiguous_literals},
            propagate_positions=True,
            maybe_placeholders=False,
            priority="invert",
        )
    return _PARSER


class _Builder:
    """Turns cel-python's lark tree into `_Node`s, decoding literals and expanding macros."""

    def __init__(self, source: str) -> None:
        self.source = source

    def syntax(self, message: str, line: int, col: int) -> CelSyntaxError:
        return CelSyntaxError(message, line, col, self.source)

    @staticmethod
    def start(t: lark.Tree | lark.Token) -> tuple[int, int]:
        if isinstance(t, lark.Token):
            return t.line or 1, t.column or 1
        meta = t.meta
        if getattr(meta, "empty", True) is False or hasattr(meta, "line"):
            return meta.line, meta.column
        return 1, 1

    def build(self, t: lark.Tree) -> _Node:
        d = t.data
        ch = t.children
        if d in ("expr", "conditionalor", "conditionaland", "relation", "addition", "multiplication"):
            if len(ch) == 1:
                return self.build(ch[0])
            if d == "expr":
                c = self.build(ch[0])
                return _Node("?:", [c, self.build(ch[1]), self.build(ch[2])], c.line, c.col)
            if d in ("conditionalor", "conditionaland"):
                left, right = self.build(ch[0]), self.build(ch[1])
                op = "||" if d == "conditionalor" else "&&"
                line, col = self.op_pos(ch[0], right, op)
                return _Node(op, [left, right], line, col)
            op_tree = ch[0]
            op = _BINARY[op_tree.data]
            left, right = self.build(op_tree.children[0]), self.build(ch[1])
            meta = op_tree.meta
            line, col = (meta.end_line, meta.end_column - len(op)) if hasattr(meta, "end_line") else (1, 1)
            return _Node(op, [left, right], line, col)
        if d == "unary":
            if len(ch) == 1:
                return self.build(ch[0])
            line, col = self.start(ch[0]) if ch[0].children or hasattr(ch[0].meta, "line") else self.start(t)
            op = "!" if ch[0].data == "unary_not" else "neg"
            return _Node(op, [self.build(ch[1])], line, col)
        if d in ("member", "primary"):
            return self.build(ch[0])
        if d == "paren_expr":
            return self.build(ch[0])
        if d == "member_dot":
            tok = ch[1]
            return _Node("select", [self.build(ch[0])], tok.line, tok.column, value=str(tok))
        if d == "member_dot_arg":
            tok = ch[1]
            target = self.build(ch[0])
            args = self.exprlist(ch[2]) if len(ch) > 2 else []
            return self.call(str(tok), target, args, tok.line, tok.column)
        if d == "member_index":
            target = self.build(ch[0])
            meta = ch[0].meta
            line, col = (meta.end_line, meta.end_column) if hasattr(meta, "end_line") else self.start(t)
            return _Node("index", [target, self.build(ch[1])], line, col)
        if d == "member_object":
            line, col = self.start(t)
            raise self.syntax("message construction (Type{field: value}) is not supported", line, col)
        if d in ("ident_arg", "dot_ident_arg"):
            tok = ch[0]
            self.not_reserved(tok)
            args = self.exprlist(ch[1]) if len(ch) > 1 else []
            return self.call(str(tok), None, args, tok.line, tok.column)
        if d in ("ident", "dot_ident"):
            tok = ch[0]
            self.not_reserved(tok)
            return _Node("ident", [], tok.line, tok.column, value=str(tok))
        if d == "list_lit":
            line, col = self.start(t)
            return _Node("list", self.exprlist(ch[0]) if ch else [], line, col)
        if d == "map_lit":
            line, col = self.start(t)
            items = [self.build(c) for c in ch[0].children] if ch else []
            return _Node("map", items, line, col)
        if d == "literal":
            return self.literal(ch[0])
        line, col = self.start(t)
        raise self.syntax(f"unsupported syntax: {d}", line, col)  # pragma: no cover

    def not_reserved(self, tok: lark.Token) -> None:
        if str(tok) in _RESERVED:
            raise self.syntax(f"{str(tok)!r} is a reserved word", tok.line or 1, tok.column or 1)

    def op_pos(self, left_tree: lark.Tree, right: _Node, op: str) -> tuple[int, int]:
        meta = left_tree.meta
        if not hasattr(meta, "end_line"):
            return right.line, right.col
        # The operator is the first non-blank text after the left operand.
        offset = meta.end_pos
        idx = self.source.find(op, offset)
        if idx < 0:
            return right.line, right.col
        line = self.source.count("\n", 0, idx) + 1
        col = idx - (self.source.rfind("\n", 0, idx) + 1) + 1
        return line, col

    def exprlist(self, t: lark.Tree) -> list[_Node]:
        return [self.build(c) for c in t.children]

    def call(self, name: str, target: _Node | None, args: list[_Node], line: int, col: int) -> _Node:
        if target is None and name == "has":
            if len(args) != 1 or args[0].op != "select":
                raise self.syntax("has() takes a single field selection, e.g. has(x.field)", line, col)
            sel = args[0]
            return _Node("has", sel.args, sel.line, sel.col, value=sel.value)
        if target is not None and name in _COMPREHENSIONS:
            want = (2, 3) if name == "map" else (2,)
            if len(args) not in want:
                raise self.syntax(f"{name}() macro takes {' or '.join(map(str, want))} arguments", line, col)
            if args[0].op != "ident":
                raise self.syntax(f"the first argument of {name}() must be a variable name", line, col)
            return _Node("comp:" + name, [target, *args[1:]], line, col, value=args[0].value)
        if target is not None:
            return _Node("call", [target, *args], line, col, value=name, method=True)
        return _Node("call", args, line, col, value=name)

    def literal(self, tok: lark.Token) -> _Node:
        line, col = tok.line or 1, tok.column or 1
        text = str(tok)
        kind = tok.type
        if kind == "INT_LIT":
            v = self.parse_int(text)
            if not rt.IMIN <= v <= rt.IMAX:
                raise self.syntax(f"int literal out of range: {text}", line, col)
            return self.lit(v, INT, line, col)
        if kind == "UINT_LIT":
            body = text[:-1]
            if body.startswith("-"):
                raise self.syntax(f"uint literal cannot be negative: {text}", line, col)
            v = self.parse_int(body)
            if v > rt.UMAX:
                raise self.syntax(f"uint literal out of range: {text}", line, col)
            return self.lit(v, UINT, line, col)
        if kind == "FLOAT_LIT":
            return self.lit(float(text), DOUBLE, line, col)
        if kind in ("STRING_LIT", "MLSTRING_LIT"):
            s = self.decode(text, False, line, col)
            assert isinstance(s, str)
            return self.lit(s, STRING.with_size(len(s)), line, col)
        if kind == "BYTES_LIT":
            b = self.decode(text[1:], True, line, col)
            assert isinstance(b, bytes)
            return self.lit(b, BYTES.with_size(len(b)), line, col)
        if kind == "BOOL_LIT":
            return self.lit(text == "true", BOOL, line, col)
        if kind == "NULL_LIT":
            return self.lit(None, NULL, line, col)
        raise self.syntax(f"unsupported literal {text!r}", line, col)  # pragma: no cover

    @staticmethod
    def lit(value: Any, t: CelType, line: int, col: int) -> _Node:
        n = _Node("lit", [], line, col, value=value)
        n.t = t
        return n

    @staticmethod
    def parse_int(text: str) -> int:
        neg = text.startswith("-")
        body = text[1:] if neg else text
        v = int(body[2:], 16) if body[:2].lower() == "0x" else int(body, 10)
        return -v if neg else v

    def decode(self, text: str, as_bytes: bool, line: int, col: int) -> str | bytes:
        raw = text[:1] in "rR"
        if raw:
            text = text[1:]
        quote = 3 if text[:3] in ('"""', "'''") else 1
        body = text[quote:-quote]
        if raw:
            return body.encode("utf-8") if as_bytes else body
        out: list[bytes] = []
        pos = 0
        for m in _ESCAPE.finditer(body):
            out.append(body[pos : m.start()].encode("utf-8", "surrogatepass"))
            pos = m.end()
            simple, hx, u4, u8, octal, _bad = m.groups()
            if simple is not None:
                out.append(_SIMPLE_ESCAPES[simple].encode())
            elif hx is not None or octal is not None:
                code = int(hx, 16) if hx is not None else int(octal, 8)
                out.append(bytes([code]) if as_bytes else chr(code).encode("utf-8"))
            elif u4 is not None or u8 is not None:
                if as_bytes:
                    raise self.syntax("\\u and \\U escapes are not allowed in bytes literals", line, col)
                code = int(u4 or u8, 16)
                if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                    raise self.syntax(f"invalid unicode escape {m.group()!r}", line, col)
                out.append(chr(code).encode("utf-8"))
            else:
                raise self.syntax(f"invalid escape sequence {m.group()!r} in string literal", line, col)
        out.append(body[pos:].encode("utf-8", "surrogatepass"))
        data = b"".join(out)
        if as_bytes:
            return data
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise self.syntax("string literal escapes do not form valid UTF-8", line, col) from None


def _parse(source: str) -> _Node:
    try:
        tree = _lark().parse(source)
    except UnexpectedInput as exc:
        raise _syntax_error(source, exc) from None
    return _Builder(source).build(tree)


def subexpressions(source: str) -> list[str]:
    """Source text of every sub-expression of `source` (outermost first, in reading order, no duplicates).

    For explaining a rule: each text can be compiled and evaluated on its own, except those that use a
    comprehension's loop variable. Raises CelSyntaxError for text that does not parse.
    """
    try:
        tree = _lark().parse(source)
    except UnexpectedInput as exc:
        raise _syntax_error(source, exc) from None
    spans = set()
    for sub in tree.iter_subtrees():
        meta = sub.meta
        if not getattr(meta, "empty", True):
            spans.add((meta.start_pos, meta.end_pos))
    out: list[str] = []
    for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
        text = source[start:end].strip()
        if text and text not in out:
            out.append(text)
    return out


def _end_position(source: str) -> tuple[int, int]:
    lines = source.split("\n")
    return len(lines), len(lines[-1]) + 1


def _syntax_error(source: str, exc: UnexpectedInput) -> CelSyntaxError:
    if (isinstance(exc, UnexpectedToken) and exc.token.type == "$END") or isinstance(exc, UnexpectedEOF):
        line, col = _end_position(source)
        return CelSyntaxError("unexpected end of expression", line, col, source)
    line, col = exc.line, exc.column
    if isinstance(exc, UnexpectedCharacters):
        ch = source[exc.pos_in_stream] if 0 <= exc.pos_in_stream < len(source) else "?"
        return CelSyntaxError(f"unexpected character {ch!r}", line, col, source)
    if isinstance(exc, UnexpectedToken):
        tok = exc.token
        if tok.type == "RESERVED":
            return CelSyntaxError(f"{str(tok)!r} is a reserved word", line, col, source)
        expected = sorted({_terminal_text(name) for name in exc.expected})
        hint = f"; expected one of: {', '.join(expected)}" if expected and len(expected) <= 12 else ""
        return CelSyntaxError(f"unexpected {str(tok)!r}{hint}", line, col, source)
    return CelSyntaxError(str(exc).splitlines()[0], line, col, source)  # pragma: no cover


def _terminal_text(name: str) -> str:
    try:
        pattern = _lark().get_terminal(name).pattern
    except KeyError:  # pragma: no cover
        return name
    if pattern.type == "str":
        return repr(pattern.value)
    return name.lower().replace("_lit", " literal").replace("ident", "identifier")


# --------------------------------------------------------------------------------------------- checker

_ORDERED = {"int", "uint", "double", "string", "bytes", "bool", "timestamp", "duration"}
_EQ_NATIVE = {"int", "uint", "double", "string", "bytes", "bool", "timestamp", "duration"}
_HASHABLE_IN = {"int", "uint", "string", "bytes", "bool", "timestamp", "duration"}
_CONVERSIONS: dict[str, set[str]] = {
    "int": {"int", "uint", "double", "string", "timestamp"},
    "uint": {"int", "uint", "double", "string"},
    "double": {"int", "uint", "double", "string"},
    "string": {"int", "uint", "double", "string", "bytes", "bool", "timestamp", "duration"},
}
_CONVERSION_RESULT = {"int": INT, "uint": UINT, "double": DOUBLE, "string": STRING}
_STRING_SIZE = {"int": 20, "uint": 20, "double": 32, "bool": 5, "timestamp": 40, "duration": 40}
_STRING_METHODS = {"startsWith", "endsWith", "contains", "matches"}
_FOLDABLE = {
    "!", "neg", "+", "-", "*", "/", "%", "==", "!=", "<", "<=", ">", ">=", "?:", "&&", "||", "call",
}  # fmt: skip
_FOLD_AT_COMPILE = {"bytes_of", "duration", "timestamp"}


def _compat(a: CelType, b: CelType) -> bool:
    if a.kind == "dyn" or b.kind == "dyn":
        return True
    if a.kind != b.kind:
        return False
    if a.kind == "message":
        return a == b
    return all(_compat(x, y) for x, y in zip(a.params, b.params, strict=True))


def _join(a: CelType, b: CelType) -> CelType | None:
    """The common type of two branches / elements, or None."""
    if a.kind == "null" and b.kind != "null":
        return b.as_nullable()
    if b.kind == "null" and a.kind != "null":
        return a.as_nullable()
    if not _compat(a, b):
        return None
    nullable = a.nullable or b.nullable
    if a.kind == "dyn" or b.kind == "dyn":
        return DYN
    size = max(a.max_size, b.max_size) if a.max_size is not None and b.max_size is not None else None
    if a.kind == "list":
        inner = _join(a.elem, b.elem)
        assert inner is not None
        return list_of(inner, size).as_nullable(nullable)
    if a.kind == "map":
        k, v = _join(a.key, b.key), _join(a.elem, b.elem)
        assert k is not None and v is not None
        return map_of(k, v, size).as_nullable(nullable)
    return a.with_size(size).as_nullable(nullable)


def _nullable_eq(a: CelType, b: CelType) -> bool:
    """`x == null` is allowed when x may be null (optional fields, messages, dyn)."""
    if a.kind == "null":
        a, b = b, a
    return b.kind == "null" and (a.nullable or a.kind in ("null", "dyn", "message"))


def _slen(t: CelType) -> int:
    return t.max_size if t.max_size is not None and t.kind in ("string", "bytes") else DEFAULT_MAX_STRING


def _items(t: CelType) -> int:
    return t.max_size if t.max_size is not None and t.kind in ("list", "map") else DEFAULT_MAX_LIST


def _sum_size(a: CelType, b: CelType) -> int | None:
    return a.max_size + b.max_size if a.max_size is not None and b.max_size is not None else None


class _Checker:
    """Type-checks a tree against an Env, annotating every node with its type."""

    def __init__(self, env: Env, source: str) -> None:
        self.env = env
        self.source = source

    def error(self, n: _Node, message: str) -> CelTypeError:
        return CelTypeError(message, n.line, n.col, self.source)

    def check(self, n: _Node, scope: dict[str, CelType]) -> CelType:
        t = self._check(n, scope)
        n.t = t
        return t

    def _check(self, n: _Node, scope: dict[str, CelType]) -> CelType:
        op = n.op
        if op == "lit":
            return n.t
        if op == "ident":
            name = n.value
            if name in scope:
                return scope[name]
            if name in self.env.variables:
                return self.env.variables[name]
            raise self.error(
                n, f"undeclared variable '{name}'{_did_you_mean(name, [*scope, *self.env.variables])}"
            )
        if op in ("select", "has"):
            ot = self.check(n.args[0], scope)
            field = n.value
            if ot.kind == "message":
                fields = ot.fields()
                if field not in fields:
                    raise self.error(n, f"unknown field '{field}' on {ot}{_did_you_mean(field, fields)}")
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
            if ot.kind == "list":
                if it.kind not in ("int", "uint", "dyn"):
                    raise self.error(n, f"list index must be int, got {it}")
                return ot.elem
            if ot.kind == "map":
                if not _compat(it, ot.key):
                    raise self.error(n, f"map key must be {ot.key}, got {it}")
                return ot.elem
            if ot.kind == "dyn":
                return DYN
            raise self.error(n, f"cannot index a value of type {ot}")
        if op == "list":
            if not n.args:
                return list_of(DYN, 0)
            elem = self.check(n.args[0], scope)
            for a in n.args[1:]:
                at = self.check(a, scope)
                joined = _join(elem, at)
                if joined is None:
                    raise self.error(a, f"list elements must have one type: {elem} and {at}")
                elem = joined
            return list_of(elem, len(n.args))
        if op == "map":
            if not n.args:
                return map_of(DYN, DYN, 0)
            kt: CelType | None = None
            vt: CelType | None = None
            for i in range(0, len(n.args), 2):
                k, v = n.args[i], n.args[i + 1]
                ct, cv = self.check(k, scope), self.check(v, scope)
                if ct.kind not in ("int", "uint", "bool", "string", "dyn"):
                    raise self.error(k, f"map keys must be int, uint, bool or string, not {ct}")
                nk = ct if kt is None else _join(kt, ct)
                nv = cv if vt is None else _join(vt, cv)
                if nk is None:
                    raise self.error(k, f"map keys must have one type: {kt} and {ct}")
                if nv is None:
                    raise self.error(v, f"map values must have one type: {vt} and {cv}")
                kt, vt = nk.with_size(None).as_nullable(False), nv
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
            if not (_compat(a, b) or _nullable_eq(a, b)):
                raise self.error(n, f"cannot compare {a} {op} {b} (operands must have the same type)")
            return BOOL
        if op in ("<", "<=", ">", ">="):
            a, b = self.check(n.args[0], scope), self.check(n.args[1], scope)
            ok = (a.kind == b.kind and a.kind in _ORDERED) or (
                "dyn" in (a.kind, b.kind) and {a.kind, b.kind} <= (_ORDERED | {"dyn"})
            )
            if not ok:
                raise self.error(n, f"operator '{op}' is not defined for {a} and {b}")
            return BOOL
        if op == "in":
            a, b = self.check(n.args[0], scope), self.check(n.args[1], scope)
            if b.kind == "list":
                if not (_compat(a, b.elem) or _nullable_eq(a, b.elem)):
                    raise self.error(n, f"'in': cannot look for {a} in {b}")
            elif b.kind == "map":
                if not _compat(a, b.key):
                    raise self.error(n, f"'in': cannot look for {a} among the keys of {b}")
            elif b.kind != "dyn":
                raise self.error(n, f"'in' needs a list or a map on the right, got {b}")
            return BOOL
        if op.startswith("comp:"):
            return self.comprehension(n, scope)
        if op == "call":
            return self.call(n, scope)
        raise self.error(n, f"unsupported expression {op!r}")  # pragma: no cover

    def want_bool(self, n: _Node, scope: dict[str, CelType], what: str) -> None:
        t = self.check(n, scope)
        if t.kind not in ("bool", "dyn"):
            raise self.error(n, f"{what} must be bool, got {t}")

    def arith(self, n: _Node, scope: dict[str, CelType]) -> CelType:
        op = n.op
        a, b = self.check(n.args[0], scope), self.check(n.args[1], scope)
        ka, kb = a.kind, b.kind
        numeric = {"int", "uint", "double"}
        if "dyn" in (ka, kb):
            other = kb if ka == "dyn" else ka
            if (
                other in numeric | {"dyn"}
                or (op in "+-" and other in {"timestamp", "duration"})
                or (op == "+" and other in {"string", "bytes", "list"})
            ):
                return DYN
        elif ka == kb:
            if ka in numeric and not (ka == "double" and op == "%"):
                return CelType(ka)
            if op == "+" and ka in ("string", "bytes"):
                return CelType(ka, max_size=_sum_size(a, b))
            if op == "+" and ka == "list":
                joined = _join(a.elem, b.elem)
                if joined is not None:
                    return list_of(joined, _sum_size(a, b))
            if ka == "duration" and op in "+-":
                return DURATION
            if ka == "timestamp" and op == "-":
                return DURATION
        elif {ka, kb} == {"timestamp", "duration"} and (op == "+" or (op == "-" and ka == "timestamp")):
            return TIMESTAMP
        hint = ""
        if {ka, kb} <= numeric:
            hint = f" (no implicit conversion: use {kb}() or {ka}())"
        raise self.error(n, f"operator '{op}' is not defined for {a} and {b}{hint}")

    def comprehension(self, n: _Node, scope: dict[str, CelType]) -> CelType:
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

    def call(self, n: _Node, scope: dict[str, CelType]) -> CelType:
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
        if name in _STRING_METHODS:
            if not n.method:
                raise self.error(n, f"{name}() is a method: use s.{name}(...)")
            if len(args) != 2:
                raise self.error(n, f"{name}() takes one argument")
            for a, t in zip(n.args, args, strict=True):
                if t.kind not in ("string", "dyn"):
                    raise self.error(a, f"{name}() is defined on strings, got {t}")
            return BOOL
        if name in _CONVERSIONS or name in ("duration", "timestamp", "bytes_of"):
            if n.method:
                raise self.error(n, f"{name}() is a function: use {name}(x)")
            if len(args) != 1:
                raise self.error(n, f"{name}() takes one argument")
            src = args[0].kind
            if name in _CONVERSIONS:
                if src not in _CONVERSIONS[name] and src != "dyn":
                    raise self.error(n, f"no conversion {name}({args[0]})")
                result = _CONVERSION_RESULT[name]
                if name == "string":
                    size = _slen(args[0]) if src in ("string", "bytes") else _STRING_SIZE.get(src)
                    return result.with_size(size)
                return result
            if name == "bytes_of":
                if src not in ("string", "int", "dyn"):
                    raise self.error(n, f'bytes_of() takes a string like "4GiB", got {args[0]}')
                return INT
            if src not in ("string", "dyn"):
                raise self.error(n, f"{name}() takes a string, got {args[0]}")
            return DURATION if name == "duration" else TIMESTAMP
        if n.method:
            raise self.error(n, f"unknown method '{name}' on {args[0]}")
        known = [
            *self.env.functions,
            "size",
            "int",
            "uint",
            "double",
            "string",
            "duration",
            "timestamp",
            "bytes_of",
        ]
        raise self.error(n, f"unknown function '{name}'{_did_you_mean(name, known)}")

    def plugin(self, n: _Node, decl: FunctionDecl, args: list[CelType]) -> CelType:
        style = f"x.{decl.name}(...)" if decl.receiver else f"{decl.name}(...)"
        if n.method != decl.receiver:
            raise self.error(n, f"{decl.name}() must be called as {style}")
        if len(args) != len(decl.args):
            raise self.error(n, f"{decl.name}() takes {len(decl.args)} arguments, got {len(args)}")
        for i, (a, want) in enumerate(zip(args, decl.args, strict=True)):
            if not _compat(a, want):
                raise self.error(n.args[i], f"argument {i + 1} of {decl.name}() must be {want}, got {a}")
        return decl.result


def _did_you_mean(name: str, candidates: Any) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


# --------------------------------------------------------------------------------------------- cost


def _cost(n: _Node, env: Env) -> int:
    op = n.op
    if op.startswith("comp:"):
        rng = n.args[0]
        body = sum(_cost(a, env) for a in n.args[1:])
        return 1 + _cost(rng, env) + _items(rng.t) * (body + 1)
    c = 1 + sum(_cost(a, env) for a in n.args)
    args = [a.t for a in n.args]
    if op in ("==", "!=", "<", "<=", ">", ">="):
        a, b = args
        if a.kind in ("string", "bytes") or b.kind in ("string", "bytes"):
            c += math.ceil(0.1 * min(_slen(a), _slen(b)))
        elif a.kind in ("list", "map") or b.kind in ("list", "map"):
            c += min(_items(a), _items(b))
        elif a.kind == "message":
            c += len(a.fields())
    elif op == "in" and args[1].kind in ("list", "dyn"):
        c += _items(args[1])
    elif op == "+" and n.t.kind in ("string", "bytes", "list"):
        size = _sum_size(args[0], args[1])
        c += math.ceil(0.1 * (size if size is not None else 2 * DEFAULT_MAX_STRING))
    elif op == "call":
        name = n.value
        decl = env.functions.get(name)
        if decl is not None:
            c += decl.cost - 1
        elif name in ("startsWith", "endsWith"):
            c += math.ceil(0.1 * _slen(args[1]))
        elif name == "contains":
            c += math.ceil(0.1 * _slen(args[0]))
        elif name == "matches":
            c += math.ceil(0.1 * _slen(args[0])) + math.ceil(0.1 * _slen(args[1]))
        elif (name in _CONVERSIONS or name in _FOLD_AT_COMPILE) and args[0].kind in (
            "string",
            "bytes",
            "dyn",
        ):
            c += math.ceil(0.1 * _slen(args[0]))
    return c


# --------------------------------------------------------------------------------------------- codegen

_HELPER_NAMES = (
        "nn", "var", "iadd", "isub", "imul", "idiv", "imod", "ineg", "uadd", "usub", "umul", "udiv", "umod",
        "fdiv", "tadd", "tsub", "duration", "timestamp", "int_of_double", "int_of_uint", "int_of_string",
        "int_of_timestamp", "uint_of_int", "uint_of_double", "uint_of_string", "double_of_string",
        "format_double", "string_of_bytes", "string_of_timestamp", "string_of_duration", "string_of",
        "bytes_of", "matches", "lidx", "mget", "sel", "mkmap", "eq", "in_list", "all_x", "exists_x",
        "as_bool",
        "d_arith", "d_neg", "d_cmp", "d_in", "d_index", "d_select", "d_has", "d_size", "d_iter", "d_str",
        "d_expect", "d_conv", "call_plugin",
)  # fmt: skip
_HELPERS: dict[str, Any] = {name: getattr(rt, name) for name in _HELPER_NAMES}
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


class _Gen:
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

    def pos(self, n: _Node) -> str:
        if not self.exact:
            return ""
        self.positions.append((n.line, n.col))
        return f", {len(self.positions) - 1}"

    def lit(self, v: Any) -> str:
        if v is None or isinstance(v, bool):
            return repr(v)
        if isinstance(v, int):
            return f"({v})" if v < 0 else repr(v)
        if isinstance(v, float):
            return f"({v!r})" if math.isfinite(v) else self.const(v)
        if isinstance(v, str | bytes):
            return repr(v)
        return self.const(v)

    def value(self, n: _Node, scope: dict[str, str], silent: bool = False) -> str:
        """Code for an operand that must not be null; `silent` where Python would not raise on None."""
        code = self.g(n, scope)
        if n.t.nullable and (self.exact or silent):
            return f"_nn({code}{self.pos(n)})"
        return code

    def cond(self, n: _Node, scope: dict[str, str]) -> str:
        code = self.value(n, scope, silent=True)
        if n.t.kind == "dyn":
            return f"_as_bool({code}{self.pos(n)})"
        return code

    def g(self, n: _Node, scope: dict[str, str]) -> str:
        op = n.op
        if op == "lit":
            return self.lit(n.value)
        if op == "ident":
            name = n.value
            if name in scope:
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
                return f"({self.g(obj, scope)}.{field} is not None)"
            if obj.t.kind == "map":
                return f"({field!r} in {self.value(obj, scope)})"
            return f"_d_has({self.g(obj, scope)}, {field!r}{self.pos(n)})"
        if op == "index":
            obj, idx = n.args
            o, i = self.value(obj, scope), self.value(idx, scope, silent=True)
            if obj.t.kind == "list" and idx.t.kind != "dyn":
                return f"_lidx({o}, {i}{self.pos(n)})"
            if obj.t.kind == "map":
                return f"_mget({o}, {i}{self.pos(n)})" if self.exact else f"{o}[{i}]"
            return f"_d_index({o}, {i}{self.pos(n)})"
        if op == "list":
            return "[" + ", ".join(self.g(a, scope) for a in n.args) + "]"
        if op == "map":
            keys = n.args[0::2]
            if all(k.op == "lit" for k in keys) and len({k.value for k in keys}) == len(keys):
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
            if a.t.kind == "dyn" or b.t.kind == "dyn":
                return f"_d_cmp({op!r}, {self.g(a, scope)}, {self.g(b, scope)}{self.pos(n)})"
            return f"({self.value(a, scope)} {op} {self.value(b, scope)})"
        if op == "in":
            return self.contains(n, scope)
        if op.startswith("comp:"):
            return self.comprehension(n, scope)
        if op == "call":
            return self.call(n, scope)
        raise AssertionError(op)  # pragma: no cover

    @staticmethod
    def flatten(n: _Node, op: str) -> list[_Node]:
        """The operands of a chain `a && b && c` (left-nested in the tree), without recursion."""
        out: list[_Node] = []
        stack = [n]
        while stack:
            cur = stack.pop()
            if cur.op == op:
                stack.extend(reversed(cur.args))
            else:
                out.append(cur)
        return out

    def select(self, n: _Node, scope: dict[str, str]) -> str:
        obj = n.args[0]
        field = n.value
        kind = obj.t.kind
        if kind == "message":
            if self.exact:
                return f"_sel({self.g(obj, scope)}, {field!r}{self.pos(n)})"
            return f"{self.g(obj, scope)}.{field}"
        if kind == "map":
            o = self.value(obj, scope)
            return f"_mget({o}, {field!r}{self.pos(n)})" if self.exact else f"{o}[{field!r}]"
        return f"_d_select({self.g(obj, scope)}, {field!r}{self.pos(n)})"

    def arith(self, n: _Node, scope: dict[str, str]) -> str:
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

    def equality(self, n: _Node, scope: dict[str, str]) -> str:
        a, b = n.args
        neg = n.op == "!="
        if (b.t.kind == "null" and a.t.kind != "dyn") or (a.t.kind == "null" and b.t.kind != "dyn"):
            other = a if b.t.kind == "null" else b
            return f"({self.g(other, scope)} is {'not ' if neg else ''}None)"
        x, y = self.g(a, scope), self.g(b, scope)
        if a.t.kind in _EQ_NATIVE and b.t.kind in _EQ_NATIVE:
            return f"({x} {n.op} {y})"
        return f"({'not ' if neg else ''}_eq({x}, {y}))"

    def contains(self, n: _Node, scope: dict[str, str]) -> str:
        a, b = n.args
        x = self.g(a, scope)
        if b.t.kind == "map":
            return f"({x} in {self.value(b, scope)})"
        if b.t.kind == "list":
            elem = b.t.elem.kind
            native = elem in _HASHABLE_IN and a.t.kind in _HASHABLE_IN
            if native and b.op == "list" and all(i.op == "lit" for i in b.args):
                values = [i.value for i in b.args]
                return f"({x} in {self.const(frozenset(values))})"
            if native:
                return f"({x} in {self.value(b, scope)})"
            return f"_in_list({x}, {self.value(b, scope)})"
        return f"_d_in({x}, {self.g(b, scope)}{self.pos(n)})"

    def comprehension(self, n: _Node, scope: dict[str, str]) -> str:
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

    def call(self, n: _Node, scope: dict[str, str]) -> str:
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
        if name in _STRING_METHODS:
            recv, arg = args
            s = self.strval(recv, scope)
            if name == "matches":
                if arg.op == "lit":
                    try:
                        rx = rt.compile_regex(arg.value)
                    except (re.error, ValueError) as exc:
                        raise CelTypeError(
                            f"invalid regular expression {arg.value!r} in matches(): {exc}", arg.line, arg.col
                        ) from None
                    return f"({self.const(rx)}.search({s}) is not None)"
                return f"_matches({s}, {self.strval(arg, scope)}{self.pos(n)})"
            p = self.strval(arg, scope)
            if name == "contains":
                return f"({p} in {s})"
            return f"{s}.{'startswith' if name == 'startsWith' else 'endswith'}({p})"
        a = args[0]
        src = a.t.kind
        if name in _CONVERSIONS:
            if src == "dyn":
                return f"_d_conv({name!r}, {self.g(a, scope)}{self.pos(n)})"
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

    def strval(self, n: _Node, scope: dict[str, str]) -> str:
        if n.t.kind == "dyn":
            return f"_d_str({self.g(n, scope)}{self.pos(n)})"
        return self.value(n, scope)


def _globals(consts: Mapping[str, Any]) -> dict[str, Any]:
    g: dict[str, Any] = {"__builtins__": builtins}
    g.update({f"_{k}": v for k, v in _HELPERS.items()})
    g["_and_"] = rt.and_
    g["_or_"] = rt.or_
    g.update(consts)
    return g


# --------------------------------------------------------------------------------------------- folding


def _fold(n: _Node, env: Env, source: str) -> _Node:
    """Evaluate pure sub-trees whose operands are all literals (bytes_of("4GiB") -> 4294967296)."""
    n.args = [_fold(a, env, source) for a in n.args]
    if n.op not in _FOLDABLE or not all(a.op == "lit" for a in n.args):
        return n
    if n.op == "call" and (n.value in env.functions or n.value == "matches"):
        return n
    consts: dict[str, Any] = {}
    gen = _Gen(env, True, consts, [])
    code = gen.g(n, {})
    try:
        value = eval(code, _globals(consts), {"A": {}})
    except CelEvalError as exc:
        if n.op == "call" and n.value in _FOLD_AT_COMPILE:
            raise CelTypeError(
                f"invalid argument to {n.value}(): {exc.message}", n.line, n.col, source
            ) from None
        return n
    except Exception:  # pragma: no cover - a helper failed unexpectedly; keep the run-time path
        return n
    if isinstance(value, list | dict):
        return n
    folded = _Node("lit", [], n.line, n.col, value=value)
    folded.t = n.t
    return folded


# --------------------------------------------------------------------------------------------- compile


class Compiled:
    """A compiled CEL expression: call it with an activation (variable name -> native value).

    `source` is the expression text, `type` the checked result type, `cost` the static cost bound and
    `python` the generated fast code (for debugging).
    """

    __slots__ = ("_exact", "_fast", "_parts", "cost", "python", "source", "type")

    def __init__(
        self,
        source: str,
        type_: CelType,
        cost: int,
        python: str,
        fast: Callable[[Mapping[str, object]], object],
        exact: Callable[[Mapping[str, object]], object],
    ) -> None:
        """Wrap the generated functions (use `compile_expr` to make one)."""
        self.source = source
        self.type = type_
        self.cost = cost
        self.python = python
        self._fast = fast
        self._exact = exact
        self._parts: tuple[str, dict[str, str], dict[str, Any]] | None = None  # fast code, hoists, constants

    def __call__(self, activation: Mapping[str, object]) -> object:
        """Evaluate; returns a native value or raises CelEvalError."""
        return self._fast(activation)

    @property
    def fn(self) -> Callable[[Mapping[str, object]], object]:
        """The generated function itself (what `__call__` calls), for hot loops that skip the method frame."""
        return self._fast

    def evaluate_exact(self, activation: Mapping[str, object]) -> object:
        """Evaluate with the exact (slow, error-absorbing) variant only; for tests and debugging."""
        return self._exact(activation)

    def __repr__(self) -> str:
        """Source, type and cost."""
        return f"<Compiled {self.source!r}: {self.type} cost={self.cost}>"


def compile_expr(
    source: str, env: Env, *, expect: CelType | None = None, cost_limit: int = 10_000
) -> Compiled:
    """Parse, type-check, bound the cost of and compile a CEL expression.

    Raises CelSyntaxError, CelTypeError (also when the result type is not `expect`) or CelCostError.
    """
    if not isinstance(source, str):
        raise TypeError(f"CEL source must be a string, not {type(source).__name__}")
    try:
        return _compile(source, env, expect, cost_limit)
    except RecursionError:
        raise CelSyntaxError("expression is nested too deeply", 1, 1, source) from None


def _compile(source: str, env: Env, expect: CelType | None, cost_limit: int) -> Compiled:
    root = _parse(source)
    checker = _Checker(env, source)
    result = checker.check(root, {})
    if expect is not None and not _compat(result, expect):
        line, col = _first_position(source)
        raise CelTypeError(
            f"expression must evaluate to {expect}, but its type is {result}", line, col, source
        )
    try:
        root = _fold(root, env, source)
    except CelTypeError as exc:
        exc.source = source
        raise
    cost = _cost(root, env)
    if cost > cost_limit:
        raise CelCostError(
            f"estimated cost {cost} exceeds the limit {cost_limit} (bound list sizes and string lengths with "
            "maxItems / maxLength, or avoid iterating large lists)",
            *_first_position(source),
            source,
        )
    consts: dict[str, Any] = {}
    positions: list[tuple[int, int]] = []
    try:
        fast_gen = _Gen(env, False, consts, positions)
        fast_code = fast_gen.g(root, {})
        exact_gen = _Gen(env, True, consts, positions)
        exact_code = exact_gen.g(root, {})
    except CelTypeError as exc:
        exc.source = source
        raise
    fast_code, exact_code = _wrap_result(result, expect, fast_code), _wrap_result(result, expect, exact_code)
    hoist = "".join(f"        {py} = A[{name!r}]\n" for name, py in fast_gen.hoisted.items())
    python = (
        "def _exact_raw(A):\n"
        f"    return {exact_code}\n"
        "def _fast(A):\n"
        "    try:\n"
        f"{hoist}"
        f"        return {fast_code}\n"
        "    except Exception:\n"
        "        pass\n"
        "    return _exact(A)\n"
    )
    g = _globals(consts)
    exact_fn = _exact_wrapper(g, positions, source)
    g["_exact"] = exact_fn
    try:
        code = compile(python, f"<cel {source[:40]!r}>", "exec")
    except (SyntaxError, RecursionError, MemoryError) as exc:
        raise CelSyntaxError(f"expression too complex to compile: {exc}", 1, 1, source) from None
    exec(code, g)
    compiled = Compiled(source, result, cost, python, g["_fast"], exact_fn)
    compiled._parts = (fast_code, dict(fast_gen.hoisted), dict(consts))
    return compiled


def _renamed(code: str, prefix: str, names: set[str]) -> str:
    """`code` with the NAME tokens in `names` prefixed (string literals and attributes are left alone)."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        text = tok.string
        if tok.type == tokenize.NAME and text in names:
            text = prefix + text
        out.append((tok.type, text))
    return tokenize.untokenize(out).strip()


def inline(c: Compiled, prefix: str) -> tuple[str, list[str], dict[str, Any]]:
    """The fast code of `c` for inlining into generated code: (expression, hoist statements, constants).

    Its hoisted variables and constants are renamed with `prefix` so that several expressions can share one
    Python frame; hoist statements read `A[...]` and may raise (the generated code must fall back then).
    The expression's globals are `helper_globals(constants)`.
    """
    if c._parts is None:
        raise ValueError(f"{c!r} was not built by compile_expr")
    code, hoisted, kconsts = c._parts
    names = set(hoisted.values()) | set(kconsts)
    expr = f"({_renamed(code, prefix, names) if names else code})"
    hoists = [f"{prefix}{py} = A[{name!r}]" for name, py in hoisted.items()]
    return expr, hoists, {prefix + k: v for k, v in kconsts.items()}


def helper_globals(consts: Mapping[str, Any]) -> dict[str, Any]:
    """Globals for code built from `inline` pieces: the runtime helpers plus the given constants."""
    return _globals(consts)


def fuse(groups: Sequence[Sequence[Compiled]]) -> Callable[[Mapping[str, object]], tuple[object, ...] | None]:
    """One function evaluating many conjunctions at once.

    `f(A)` returns, per group, the value of `c0 and c1 and ...` (each group's expressions in order,
    short-circuiting like the separate calls would). It runs every expression's fast code inline in one
    Python frame (no call per expression); when anything raises it returns None, and the caller evaluates
    group by group with each `Compiled` (exact CEL error semantics).
    """
    hoists: list[str] = []
    terms: list[str] = []
    consts: dict[str, Any] = {}
    i = 0
    for group in groups:
        parts = []
        for c in group:
            if c._parts is None:
                raise ValueError(f"{c!r} was not built by compile_expr")
            code, hoisted, kconsts = c._parts
            prefix = f"_e{i}"
            i += 1
            names = set(hoisted.values()) | set(kconsts)
            parts.append(f"({_renamed(code, prefix, names) if names else code})")
            hoists.extend(f"        {prefix}{py} = A[{name!r}]\n" for name, py in hoisted.items())
            consts.update({prefix + k: v for k, v in kconsts.items()})
        terms.append(" and ".join(parts) if parts else "True")
    body = "".join(f"            {t},\n" for t in terms)
    python = (
        "def _fused(A):\n"
        "    try:\n"
        f"{''.join(hoists)}"
        "        return (\n"
        f"{body}"
        "        )\n"
        "    except Exception:\n"
        "        return None\n"
    )
    g = _globals(consts)
    exec(compile(python, "<cel fused>", "exec"), g)
    fn: Callable[[Mapping[str, object]], tuple[object, ...] | None] = g["_fused"]
    return fn


def _wrap_result(result: CelType, expect: CelType | None, code: str) -> str:
    if expect is None:
        return code
    if result.kind == "dyn" and expect.kind != "dyn":
        return f"_d_expect({code}, {expect.kind!r})"
    if result.nullable:
        return f"_nn({code})"
    return code


def _exact_wrapper(
    g: dict[str, Any], positions: list[tuple[int, int]], source: str
) -> Callable[[Mapping[str, object]], object]:
    def exact(activation: Mapping[str, object]) -> object:
        try:
            return g["_exact_raw"](activation)
        except CelEvalError as exc:
            if exc.line is None and 0 <= exc.pos < len(positions):
                exc.line, exc.column = positions[exc.pos]
            exc.source = source
            raise
        except RecursionError:
            raise CelEvalError("expression nested too deeply", source=source) from None
        except Exception as exc:
            raise CelEvalError(f"{type(exc).__name__}: {exc}", source=source) from exc

    return exact


def _first_position(source: str) -> tuple[int, int]:
    stripped = len(source) - len(source.lstrip())
    line = source.count("\n", 0, stripped) + 1
    col = stripped - (source.rfind("\n", 0, stripped) + 1) + 1
    return line, col

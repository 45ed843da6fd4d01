"""CEL source to a tree: the error types, the tree node, and the parser adapter over cel-python's grammar.

`parse` builds `Node`s from `cel.lark` (cel-python's grammar with the optional-types syntax and quoted field
names added), decoding literals, expanding macros (`has`, comprehensions with one or two variables,
`cel.bind`, `optMap`, `optFlatMap`) and placing every node at its line and column; syntax errors say where and
what was expected. `subexpressions` lists the source text of every sub-expression, for `policy explain`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lark
from celpy.celparser import CELParser
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from nexuskv.cel.runtime import core as rt
from nexuskv.cel.syntax.literals import decode_quoted
from nexuskv.cel.types import BOOL, BYTES, DOUBLE, DYN, INT, NULL, STRING, UINT, CelType
from nexuskv.cel.values import Uint

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


class Node:
    """One node of the checked expression tree."""

    __slots__ = ("args", "col", "line", "method", "op", "t", "value")

    def __init__(
        self, op: str, args: list[Node], line: int, col: int, value: Any = None, method: bool = False
    ) -> None:
        self.op = op
        self.args = args
        self.line = line
        self.col = col
        self.value = value
        self.method = method
        self.t: CelType = DYN


_COMPREHENSIONS = {"all", "exists", "exists_one", "map", "filter"}
_TWO_VARIABLE = {"all", "exists", "exists_one", "existsOne", "transformList", "transformMap", "transformMapEntry"}
_BINARY = {
    "relation_lt": "<", "relation_le": "<=", "relation_gt": ">", "relation_ge": ">=",
    "relation_eq": "==", "relation_ne": "!=", "relation_in": "in",
    "addition_add": "+", "addition_sub": "-",
    "multiplication_mul": "*", "multiplication_div": "/", "multiplication_mod": "%",
}  # fmt: skip
_RESERVED = frozenset({
    "as", "break", "const", "continue", "else", "for", "function", "if", "import", "let", "loop", "package",
    "namespace", "return", "var", "void", "while",
})  # fmt: skip
_PARSER: lark.Lark | None = None


def grammar_parser() -> lark.Lark:
    """Our own instance of cel-python's grammar (its shared parser may build other tree classes)."""
    global _PARSER
    if _PARSER is None:
        grammar = (Path(__file__).parent / "cel.lark").read_text(encoding="utf-8")
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
    """Turns cel-python's lark tree into `Node`s, decoding literals and expanding macros."""

    def __init__(self, source: str, macros: bool = True) -> None:
        self.source = source
        self.macros = macros

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

    def build(self, t: lark.Tree) -> Node:
        d = t.data
        ch = t.children
        if d in ("expr", "conditionalor", "conditionaland", "relation", "addition", "multiplication"):
            if len(ch) == 1:
                return self.build(ch[0])
            if d == "expr":
                c = self.build(ch[0])
                return Node("?:", [c, self.build(ch[1]), self.build(ch[2])], c.line, c.col)
            if d in ("conditionalor", "conditionaland"):
                left, right = self.build(ch[0]), self.build(ch[1])
                op = "||" if d == "conditionalor" else "&&"
                line, col = self.op_pos(ch[0], right, op)
                return Node(op, [left, right], line, col)
            op_tree = ch[0]
            op = _BINARY[op_tree.data]
            left, right = self.build(op_tree.children[0]), self.build(ch[1])
            meta = op_tree.meta
            line, col = (meta.end_line, meta.end_column - len(op)) if hasattr(meta, "end_line") else (1, 1)
            return Node(op, [left, right], line, col)
        if d == "unary":
            if len(ch) == 1:
                return self.build(ch[0])
            line, col = self.start(ch[0]) if ch[0].children or hasattr(ch[0].meta, "line") else self.start(t)
            op = "!" if ch[0].data == "unary_not" else "neg"
            return Node(op, [self.build(ch[1])], line, col)
        if d in ("member", "primary"):
            return self.build(ch[0])
        if d == "paren_expr":
            return self.build(ch[0])
        if d in ("member_dot", "member_dot_opt"):
            tok = ch[1]
            field = str(tok)[1:-1] if tok.type == "QUOTED_IDENT" else str(tok)
            op = "select" if d == "member_dot" else "optselect"
            return Node(op, [self.build(ch[0])], tok.line, tok.column, value=field)
        if d == "member_index_opt":
            line, col = self.start(t)
            return Node("optindex", [self.build(ch[0]), self.build(ch[1])], line, col)
        if d == "member_dot_arg":
            tok = ch[1]
            target = self.build(ch[0])
            args = self.exprlist(ch[2]) if len(ch) > 2 else []
            return self.call(str(tok), target, args, tok.line, tok.column)
        if d == "member_index":
            target = self.build(ch[0])
            meta = ch[0].meta
            line, col = (meta.end_line, meta.end_column) if hasattr(meta, "end_line") else self.start(t)
            return Node("index", [target, self.build(ch[1])], line, col)
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
            return Node("ident", [], tok.line, tok.column, value=("." if d == "dot_ident" else "") + str(tok))
        if d == "list_lit":
            line, col = self.start(t)
            return Node("list", [self.element(c.children[0]) for c in ch[0].children] if ch else [], line, col)
        if d == "map_lit":
            line, col = self.start(t)
            items: list[Node] = []
            for init in ch[0].children if ch else []:
                key, value = init.children
                if key.data == "opt_key":
                    items += [self.build(key.children[0]), self.optional_part(self.build(value))]
                else:
                    items += [self.build(key), self.build(value)]
            return Node("map", items, line, col)
        if d == "literal":
            return self.literal(ch[0])
        line, col = self.start(t)
        raise self.syntax(f"unsupported syntax: {d}", line, col)  # pragma: no cover

    def element(self, t: lark.Tree) -> Node:
        if t.data == "opt_elem":
            return self.optional_part(self.build(t.children[0]))
        return self.build(t)

    @staticmethod
    def optional_part(n: Node) -> Node:
        """`?x` in a list or map literal: included only when the optional x has a value."""
        return Node("optelem", [n], n.line, n.col)

    def not_reserved(self, tok: lark.Token) -> None:
        if str(tok) in _RESERVED:
            raise self.syntax(f"{str(tok)!r} is a reserved word", tok.line or 1, tok.column or 1)
        if str(tok) == "in":  # an operator, never an identifier (cel-spec's IDENT excludes it)
            raise self.syntax("'in' is an operator, not an identifier", tok.line or 1, tok.column or 1)

    def op_pos(self, left_tree: lark.Tree, right: Node, op: str) -> tuple[int, int]:
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

    def exprlist(self, t: lark.Tree) -> list[Node]:
        return [self.build(c) for c in t.children]

    def call(self, name: str, target: Node | None, args: list[Node], line: int, col: int) -> Node:
        if self.macros:
            macro = self.macro(name, target, args, line, col)
            if macro is not None:
                return macro
        if target is not None:
            return Node("call", [target, *args], line, col, value=name, method=True)
        return Node("call", args, line, col, value=name)

    def macro(self, name: str, target: Node | None, args: list[Node], line: int, col: int) -> Node | None:
        """The node of a macro call, or None when `name(args)` is no macro."""
        two = len(args) >= 3 and args[0].op == "ident" and args[1].op == "ident"
        if target is not None and name in _TWO_VARIABLE and two:
            want = (4, 3) if name.startswith("transform") else (3,)
            if len(args) not in want:
                raise self.syntax(f"{name}() macro takes {' or '.join(map(str, want))} arguments", line, col)
            op = "comp2:" + ("exists_one" if name == "existsOne" else name)
            return Node(op, [target, *args[2:]], line, col, value=(args[0].value, args[1].value))
        if target is not None and name == "existsOne":
            name = "exists_one"
        if target is not None and target.op == "ident" and target.value == "cel" and name == "bind":
            if len(args) != 3 or args[0].op != "ident":
                raise self.syntax("cel.bind() takes a variable name, a value and an expression", line, col)
            return Node("bind", args[1:], line, col, value=args[0].value)
        if target is not None and name in ("optMap", "optFlatMap"):
            if len(args) != 2 or args[0].op != "ident":
                raise self.syntax(f"{name}() takes a variable name and an expression", line, col)
            return Node("comp:" + name, [target, args[1]], line, col, value=args[0].value)
        if target is None and name == "has":
            if len(args) != 1 or args[0].op != "select":
                raise self.syntax("has() takes a single field selection, e.g. has(x.field)", line, col)
            sel = args[0]
            return Node("has", sel.args, sel.line, sel.col, value=sel.value)
        if target is not None and name in _COMPREHENSIONS:
            want = (2, 3) if name == "map" else (2,)
            if len(args) not in want:
                raise self.syntax(f"{name}() macro takes {' or '.join(map(str, want))} arguments", line, col)
            if args[0].op != "ident":
                raise self.syntax(f"the first argument of {name}() must be a variable name", line, col)
            return Node("comp:" + name, [target, *args[1:]], line, col, value=args[0].value)
        return None

    def literal(self, tok: lark.Token) -> Node:
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
            return self.lit(Uint(v), UINT, line, col)
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
    def lit(value: Any, t: CelType, line: int, col: int) -> Node:
        n = Node("lit", [], line, col, value=value)
        n.t = t
        return n

    @staticmethod
    def parse_int(text: str) -> int:
        neg = text.startswith("-")
        body = text[1:] if neg else text
        v = int(body[2:], 16) if body[:2].lower() == "0x" else int(body, 10)
        return -v if neg else v

    def decode(self, text: str, as_bytes: bool, line: int, col: int) -> str | bytes:
        try:
            return decode_quoted(text, as_bytes)
        except ValueError as exc:
            raise self.syntax(str(exc), line, col) from None


def parse_tree(source: str) -> lark.Tree:
    """The raw parse tree of `source` in NexusKV's CEL grammar (what policy coverage walks for its conditions)."""
    return grammar_parser().parse(source)


def parse(source: str, macros: bool = True) -> Node:
    """Parse CEL source into a tree of `Node`s; raises CelSyntaxError with line and column.

    With `macros=False`, `has`, `all`, `exists`... are plain function calls (CEL's macro-free parse).
    """
    try:
        tree = grammar_parser().parse(source)
    except UnexpectedInput as exc:
        raise _syntax_error(source, exc) from None
    return _Builder(source, macros).build(tree)


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
        pattern = grammar_parser().get_terminal(name).pattern
    except KeyError:  # pragma: no cover
        return name
    if pattern.type == "str":
        return repr(pattern.value)
    return name.lower().replace("_lit", " literal").replace("ident", "identifier")
